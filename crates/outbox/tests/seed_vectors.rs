//! Every vector in `shared/seed/key-vectors.json`, computed with the seed's own Python
//! functions, reproduced byte for byte.

#![allow(clippy::unwrap_used)]

use std::num::NonZeroU64;
use std::path::PathBuf;

use outbox::timestamp::{epoch_millis, parse_timestamptz};
use outbox::{compute_keys, shard_for_key};
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    compute_keys: Vec<KeyVector>,
    shard_for_key: Vec<ShardVector>,
    created_at_to_epoch_ms: Vec<TimeVector>,
}

#[derive(Deserialize)]
struct KeyVector {
    id: i64,
    entity_id: String,
    event_type: String,
    created_at_epoch_ms: i64,
    dedupe_key: String,
    partition_key: String,
    ordering_key: String,
}

#[derive(Deserialize)]
struct ShardVector {
    partition_key: String,
    partition_count: u64,
    shard: u64,
}

#[derive(Deserialize)]
struct TimeVector {
    created_at_text: String,
    epoch_micros: i64,
    epoch_ms: i64,
}

/// The checked-in copy of the seed's vectors (the seed lives outside the repository).
const CHECKED_IN: &str = include_str!("fixtures/key-vectors.json");

fn vectors() -> Vectors {
    serde_json::from_str(CHECKED_IN).expect("key-vectors.json parses")
}

/// The copy must equal the seed's file where the seed is present (`../shared/seed` beside
/// the repository, or OUTBOX_RELAY_SEED_DIR).
#[test]
fn checked_in_vectors_equal_the_seed() {
    let dir = std::env::var_os("OUTBOX_RELAY_SEED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/seed"));
    match std::fs::read_to_string(dir.join("key-vectors.json")) {
        Ok(seed) => assert_eq!(
            seed, CHECKED_IN,
            "crates/outbox/tests/fixtures/key-vectors.json differs from the seed's"
        ),
        Err(e) => eprintln!(
            "note: seed folder {} not readable ({e}); using the checked-in copy only",
            dir.display()
        ),
    }
}

#[test]
fn compute_keys_matches_every_seed_vector() {
    let vectors = vectors().compute_keys;
    assert!(vectors.len() >= 100);
    for v in &vectors {
        let keys = compute_keys(v.id, &v.entity_id, &v.event_type, v.created_at_epoch_ms);
        assert_eq!(keys.dedupe_key, v.dedupe_key);
        assert_eq!(keys.partition_key, v.partition_key);
        assert_eq!(keys.ordering_key, v.ordering_key);
    }
}

#[test]
fn shard_for_key_matches_every_seed_vector() {
    let vectors = vectors().shard_for_key;
    assert!(vectors.len() >= 700);
    for v in &vectors {
        let count = NonZeroU64::new(v.partition_count).expect("partition_count > 0");
        assert_eq!(
            shard_for_key(count, &v.partition_key),
            v.shard,
            "key {:?} count {}",
            v.partition_key,
            v.partition_count
        );
    }
}

#[test]
fn created_at_milliseconds_match_every_seed_vector() {
    for v in &vectors().created_at_to_epoch_ms {
        let micros = parse_timestamptz(v.created_at_text.as_bytes()).expect(&v.created_at_text);
        assert_eq!(micros, i128::from(v.epoch_micros), "{}", v.created_at_text);
        assert_eq!(epoch_millis(micros), v.epoch_ms, "{}", v.created_at_text);
    }
}
