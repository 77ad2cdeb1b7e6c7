//! `--atomic-transactions` at the stream: whether the server and the stream can take
//! atomic batches (`sink::batch`), and the setting on a stream the relay creates.
//!
//! # Invariants
//! - AT1 The relay publishes atomic batches only to a nats-server of version 2.12 or newer
//!   (the first with atomic batch publish) and a stream whose `allow_atomic` is set: on any
//!   other it refuses to start (a setup error naming the version or the stream setting),
//!   never falls back to per-message publishing silently.
//! - AT2 It sets `allow_atomic` only on a stream it has just created; an existing stream's
//!   settings are the operator's.
//! - AT3 `--fast-ingest` (`sink::batch` F1–F6): a session publishes fast-ingest batches only
//!   to a nats-server of version 2.14 or newer, a stream of one replica whose
//!   `allow_batched` is set, read when the session starts; anywhere else it publishes one
//!   acknowledged message per event, and says why when the mode differs from the previous
//!   session's (a setting the operator may change, not a setup error); so too in shared
//!   mode, with `--atomic-transactions` and once the server refused fast batches (F4).
//!   `--fast-ingest` is on by default: on 2.9 to 2.13 it changes nothing. `allow_batched` is
//!   set only on a stream the relay has just created (AT2).
//!
//! The stream's `allow_atomic` is read and written through the JetStream API's JSON
//! (`STREAM.INFO`, `STREAM.UPDATE`), which async-nats exposes only behind its `server_2_12`
//! feature. Decision and I/O are apart: [`judge`] over what [`check`] read.

use async_nats::jetstream;
use serde_json::Value;

use crate::config::{opt, Config};
use crate::error::{RelayError, Result};
use crate::observe::metrics::{Metrics, PublishMode};

/// The first nats-server with atomic batch publish (`allow_atomic`).
pub(crate) const FIRST_VERSION: (u64, u64) = (2, 12);

/// The first nats-server with fast-ingest batches (`allow_batched`, AT3).
pub(crate) const FAST_FIRST_VERSION: (u64, u64) = (2, 14);

/// What the server and the stream say about atomic batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Both support them.
    Ready,
    /// The stream lacks `allow_atomic`, and the relay may set it (it created the stream).
    Allow,
    /// The relay must not start: why, for the operator.
    Refused(String),
}

/// AT1, AT2: the verdict on server `version` (`INFO`'s, e.g. `2.15.1`) and the stream's
/// `allow_atomic`, for a stream the relay `created` or not.
pub(crate) fn judge(version: &str, allow_atomic: bool, created: bool, stream: &str) -> Verdict {
    let flag = opt::ATOMIC_TRANSACTIONS.flag();
    if !supports(version, FIRST_VERSION) {
        return Verdict::Refused(format!(
            "{flag} needs nats-server {}.{} or newer (atomic batch publish); this server is {version}: upgrade it, or unset {flag}",
            FIRST_VERSION.0, FIRST_VERSION.1
        ));
    }
    match (allow_atomic, created) {
        (true, _) => Verdict::Ready,
        (false, true) => Verdict::Allow,
        (false, false) => Verdict::Refused(format!(
            "{flag} needs the stream setting allow_atomic, and stream {stream} does not allow atomic publish: enable it on the stream (allow_atomic: true, nats-server 2.12 or newer), or unset {flag}"
        )),
    }
}

/// Whether `version` (`major.minor.patch`, maybe with a suffix) is at least `first`.
pub(crate) fn supports(version: &str, first: (u64, u64)) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= first,
        _ => false,
    }
}

/// AT1, AT2: checks the server and `config.stream` (`created` by this setup or not), and
/// sets `allow_atomic` on a stream it created.
pub(crate) async fn check(
    jetstream: &jetstream::Context,
    stream: &str,
    created: bool,
) -> Result<()> {
    let version = jetstream.client().server_info().version;
    let settings = stream_config(jetstream, stream).await?;
    match judge(
        &version,
        allowed(&settings, "allow_atomic"),
        created,
        stream,
    ) {
        Verdict::Ready => Ok(()),
        Verdict::Refused(why) => Err(RelayError::setup(anyhow::anyhow!(why))),
        Verdict::Allow => allow(jetstream, stream, settings, "allow_atomic").await,
    }
}

/// AT3: why a session with `--fast-ingest` publishes one message per event instead, on
/// server `version` and a stream of `replicas` whose `allow_batched` is as given; `None`:
/// it publishes fast-ingest batches.
pub(crate) fn fast_refusal(version: &str, replicas: usize, allow_batched: bool) -> Option<String> {
    if !supports(version, FAST_FIRST_VERSION) {
        return Some(format!(
            "nats-server {version} has no fast-ingest batches ({}.{} or newer has)",
            FAST_FIRST_VERSION.0, FAST_FIRST_VERSION.1
        ));
    }
    if replicas != 1 {
        return Some(format!(
            "the stream has {replicas} replicas (fast-ingest batches are used on a stream of one)"
        ));
    }
    (!allow_batched).then(|| {
        "the stream does not allow batch publish (allow_batched: true enables it)".to_owned()
    })
}

/// AT3: the session's fast batch limit, for a stream of `replicas`; `None` when it publishes
/// one message per event. The choice goes to `metrics` (`outbox_relay_publish_mode`) and,
/// when it differs from the previous session's, into one info line with the reason.
pub(crate) async fn fast_limit(
    jetstream: &jetstream::Context,
    config: &Config,
    replicas: usize,
    metrics: &Metrics,
) -> Result<Option<usize>> {
    let choice = fast_choice(jetstream, config, replicas, metrics).await?;
    let mode = match (&choice, config.atomic_transactions) {
        (Ok(_), _) => PublishMode::FastBatches,
        (Err(_), true) => PublishMode::AtomicBatches,
        (Err(_), false) => PublishMode::PerMessage,
    };
    if metrics.set_publish_mode(mode) {
        match &choice {
            Ok(limit) => {
                tracing::info!(stream = %config.stream, limit, "publishing fast-ingest batches")
            }
            Err(why) => {
                tracing::info!(stream = %config.stream, reason = %why, "publishing {}, not fast-ingest batches", mode.describe())
            }
        }
    }
    Ok(choice.ok())
}

/// AT3: the fast batch limit, or why this session publishes without fast-ingest batches.
async fn fast_choice(
    jetstream: &jetstream::Context,
    config: &Config,
    replicas: usize,
    metrics: &Metrics,
) -> Result<std::result::Result<usize, String>> {
    let flag = opt::FAST_INGEST.flag();
    if !config.fast_ingest {
        return Ok(Err(format!("{flag} is off")));
    }
    // Strict mode only (the fence proves a batch stored), and an atomic batch is one already.
    if config.shared_stream || config.atomic_transactions {
        return Ok(Err(format!(
            "{flag} is for strict mode without {}",
            opt::ATOMIC_TRANSACTIONS.flag()
        )));
    }
    if let Some(off) = metrics.sink().fast_off() {
        return Ok(Err(off));
    }
    // The server and the replicas first: a server without fast batches is asked nothing.
    let version = jetstream.client().server_info().version;
    if let Some(why) = fast_refusal(&version, replicas, true) {
        return Ok(Err(why));
    }
    let settings = stream_config(jetstream, &config.stream).await?;
    Ok(
        match fast_refusal(&version, replicas, allowed(&settings, "allow_batched")) {
            None => Ok(sink::batch::FAST_BATCH_LIMIT),
            Some(why) => Err(why),
        },
    )
}

/// AT2, AT3: sets `allow_batched` on a stream the relay `created`, under `--fast-ingest` on a
/// server that has fast-ingest batches.
pub(crate) async fn allow_fast(
    jetstream: &jetstream::Context,
    config: &Config,
    created: bool,
) -> Result<()> {
    let version = jetstream.client().server_info().version;
    if !config.fast_ingest || !created || !supports(&version, FAST_FIRST_VERSION) {
        return Ok(());
    }
    let settings = stream_config(jetstream, &config.stream).await?;
    allow(jetstream, &config.stream, settings, "allow_batched").await
}

/// `stream`'s configuration, as JSON (its `STREAM.INFO` answer's).
pub(crate) async fn stream_config(jetstream: &jetstream::Context, stream: &str) -> Result<Value> {
    let mut info: Value = jetstream
        .request(format!("STREAM.INFO.{stream}"), &serde_json::json!({}))
        .await
        .map_err(|e| RelayError::transient(anyhow::anyhow!("cannot read stream {stream}: {e}")))?;
    refusal(&info, stream, "read")?;
    Ok(info
        .get_mut("config")
        .map(Value::take)
        .unwrap_or(Value::Null))
}

/// Whether the stream configuration `settings` has `setting` (`allow_atomic`,
/// `allow_batched`) set.
fn allowed(settings: &Value, setting: &str) -> bool {
    settings
        .get(setting)
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// AT2: sets `setting` (`allow_atomic`, `allow_batched`) on `stream`, whose configuration
/// is `settings`.
async fn allow(
    jetstream: &jetstream::Context,
    stream: &str,
    mut settings: Value,
    setting: &str,
) -> Result<()> {
    if let Some(map) = settings.as_object_mut() {
        map.insert(setting.into(), Value::Bool(true));
    }
    let answer: Value = jetstream
        .request(format!("STREAM.UPDATE.{stream}"), &settings)
        .await
        .map_err(|e| {
            RelayError::transient(anyhow::anyhow!("cannot update stream {stream}: {e}"))
        })?;
    refusal(&answer, stream, &format!("set {setting} on"))?;
    tracing::info!(stream = %stream, "stream allows {setting}");
    Ok(())
}

/// An API answer's error, as the relay's.
fn refusal(answer: &Value, stream: &str, what: &str) -> Result<()> {
    match answer.get("error") {
        None => Ok(()),
        Some(error) => Err(RelayError::setup(anyhow::anyhow!(
            "cannot {what} stream {stream}: {}",
            error
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("the server refused")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_ingest_only_on_2_14_a_single_replica_and_allow_batched() {
        assert_eq!(fast_refusal("2.15.1", 1, true), None);
        assert_eq!(fast_refusal("v2.14.0", 1, true), None);
        for (version, replicas, allow, says) in [
            ("2.12.8", 1, true, "2.12.8"),
            ("2.9.10", 1, true, "2.14"),
            ("2.15.1", 3, true, "3 replicas"),
            ("2.15.1", 1, false, "allow_batched"),
        ] {
            let why = fast_refusal(version, replicas, allow).expect("refused");
            assert!(why.contains(says), "{why}");
        }
    }

    #[test]
    fn versions_before_2_12_are_refused_naming_the_version() {
        for old in ["2.9.10", "2.10.24", "2.11.9", "garbage", ""] {
            match judge(old, true, true, "S") {
                Verdict::Refused(why) => {
                    assert!(why.contains("2.12 or newer") && why.contains(old), "{why}")
                }
                other => panic!("{old}: {other:?}"),
            }
        }
        for new in ["2.12.0", "2.12.8", "2.15.1", "v3.0.0-beta"] {
            assert_eq!(judge(new, true, false, "S"), Verdict::Ready, "{new}");
        }
    }

    #[test]
    fn the_setting_is_set_only_on_a_stream_the_relay_created() {
        assert_eq!(judge("2.15.1", false, true, "S"), Verdict::Allow);
        match judge("2.15.1", false, false, "S") {
            Verdict::Refused(why) => assert!(why.contains("allow_atomic") && why.contains("S")),
            other => panic!("{other:?}"),
        }
    }
}
