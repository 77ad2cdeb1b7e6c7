//! The seed's key derivation, reproduced byte for byte.
//!
//! The seed (`deterministic-shard-aware-outbox.md`) defines, in Python:
//! ```text
//! dedupe_key    = f"{event_type}:{entity_id}:{outbox_id}"
//! partition_key = entity_id
//! ordering_key  = f"{created_at_epoch_ms:013d}:{outbox_id:020d}"
//! shard         = int.from_bytes(sha256(partition_key.encode("utf-8")).digest()[:8], "big") % partition_count
//! ```
//! # Invariants
//! - K1 Every key is a pure function of the row's `id`, `entity_id`, `event_type` and
//!   `created_at`: the same row always yields the same keys and shard, on every replay.
//! - K2 Rust's `{:013}` / `{:020}` pad sign-aware exactly like Python's `:013d` / `:020d`
//!   (`-5` → `-000000000005`), so negative milliseconds (before 1970) match the seed too.
//! - K3 `created_at_epoch_ms` is the exact floor of the microsecond timestamp (integer
//!   arithmetic, no floating point; see [`crate::timestamp`]).

use std::fmt::Write as _;
use std::num::NonZeroU64;

use sha2::{Digest, Sha256};

/// The three keys the seed derives for one outbox row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Keys {
    /// `{event_type}:{entity_id}:{id}`: the consumer's idempotency key and our `Nats-Msg-Id`.
    pub dedupe_key: String,
    /// `entity_id`: what the shard is derived from.
    pub partition_key: String,
    /// `{created_at_ms:013}:{id:020}`: sorts like (created_at, id) for non-negative times.
    pub ordering_key: String,
}

/// The seed's `compute_keys`.
pub fn compute_keys(id: i64, entity_id: &str, event_type: &str, created_at_epoch_ms: i64) -> Keys {
    let mut dedupe_key = String::with_capacity(event_type.len() + entity_id.len() + 22);
    dedupe_key.push_str(event_type);
    dedupe_key.push(':');
    dedupe_key.push_str(entity_id);
    dedupe_key.push(':');
    // Writing to a String cannot fail.
    let _ = write!(dedupe_key, "{id}");
    Keys {
        dedupe_key,
        partition_key: entity_id.to_owned(),
        ordering_key: ordering_key(id, created_at_epoch_ms),
    }
}

/// The seed's `ordering_key` alone: `{created_at_ms:013}:{id:020}` (what a stored message's
/// `Outbox-Ordering-Key` is checked against when only the row's id and time are at hand).
pub fn ordering_key(id: i64, created_at_epoch_ms: i64) -> String {
    let mut ordering_key = String::with_capacity(34);
    // Writing to a String cannot fail.
    let _ = write!(ordering_key, "{created_at_epoch_ms:013}:{id:020}");
    ordering_key
}

/// The seed's `shard_for_key`: the first 8 bytes of SHA-256(key) as a big-endian `u64`,
/// modulo the partition count.
pub fn shard_for_key(partition_count: NonZeroU64, key: &str) -> u64 {
    let digest = Sha256::digest(key.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first) % partition_count.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_walkthrough_example() {
        let keys = compute_keys(1, "order:A-1", "OrderCreated", 1_700_000_000_000);
        assert_eq!(keys.dedupe_key, "OrderCreated:order:A-1:1");
        assert_eq!(keys.partition_key, "order:A-1");
        assert_eq!(keys.ordering_key, "1700000000000:00000000000000000001");
    }

    #[test]
    fn negative_times_pad_like_python() {
        assert_eq!(
            compute_keys(1, "e", "t", -5).ordering_key,
            "-000000000005:00000000000000000001"
        );
    }

    #[test]
    fn one_partition_is_always_shard_zero() {
        assert_eq!(shard_for_key(NonZeroU64::MIN, "anything"), 0);
    }
}
