//! `--atomic-transactions` at the stream: whether the server and the stream can take
//! atomic batches (`sink::batch`), and the setting on a stream the relay creates.
//!
//! # Invariants
//! - X1 The relay publishes atomic batches only to a nats-server of version 2.12 or newer
//!   (the first with atomic batch publish) and a stream whose `allow_atomic` is set: on any
//!   other it refuses to start (a setup error naming the version or the stream setting),
//!   never falls back to per-message publishing silently.
//! - X2 It sets `allow_atomic` only on a stream it has just created; an existing stream's
//!   settings are the operator's.
//!
//! The stream's `allow_atomic` is read and written through the JetStream API's JSON
//! (`STREAM.INFO`, `STREAM.UPDATE`), which async-nats exposes only behind its `server_2_12`
//! feature. Decision and I/O are apart: [`judge`] over what [`check`] read.

use async_nats::jetstream;
use serde_json::Value;

use crate::config::{opt, Config};
use crate::error::{RelayError, Result};

/// The first nats-server with atomic batch publish (`allow_atomic`).
pub(crate) const FIRST_VERSION: (u64, u64) = (2, 12);

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

/// X1, X2: the verdict on server `version` (`INFO`'s, e.g. `2.15.1`) and the stream's
/// `allow_atomic`, for a stream the relay `created` or not.
pub(crate) fn judge(version: &str, allow_atomic: bool, created: bool, stream: &str) -> Verdict {
    let flag = opt::ATOMIC_TRANSACTIONS.flag();
    if !supports(version) {
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

/// Whether `version` (`major.minor.patch`, maybe with a suffix) is at least
/// [`FIRST_VERSION`].
fn supports(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= FIRST_VERSION,
        _ => false,
    }
}

/// X1, X2: checks the server and `config.stream` (`created` by this bootstrap or not), and
/// sets `allow_atomic` on a stream it created.
pub(crate) async fn check(
    jetstream: &jetstream::Context,
    config: &Config,
    created: bool,
) -> Result<()> {
    let version = jetstream.client().server_info().version;
    let info = stream_info(jetstream, &config.stream).await?;
    let settings = info.get("config").cloned().unwrap_or(Value::Null);
    let allow_atomic = settings
        .get("allow_atomic")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    match judge(&version, allow_atomic, created, &config.stream) {
        Verdict::Ready => Ok(()),
        Verdict::Refused(why) => Err(RelayError::setup(anyhow::anyhow!(why))),
        Verdict::Allow => allow(jetstream, &config.stream, settings).await,
    }
}

/// The stream's `STREAM.INFO` answer, as JSON.
async fn stream_info(jetstream: &jetstream::Context, stream: &str) -> Result<Value> {
    let info: Value = jetstream
        .request(format!("STREAM.INFO.{stream}"), &serde_json::json!({}))
        .await
        .map_err(|e| RelayError::transient(anyhow::anyhow!("cannot read stream {stream}: {e}")))?;
    refusal(&info, stream, "read")?;
    Ok(info)
}

/// X2: sets `allow_atomic` on `stream`, whose configuration is `settings`.
async fn allow(jetstream: &jetstream::Context, stream: &str, mut settings: Value) -> Result<()> {
    if let Some(map) = settings.as_object_mut() {
        map.insert("allow_atomic".into(), Value::Bool(true));
    }
    let answer: Value = jetstream
        .request(format!("STREAM.UPDATE.{stream}"), &settings)
        .await
        .map_err(|e| {
            RelayError::transient(anyhow::anyhow!("cannot update stream {stream}: {e}"))
        })?;
    refusal(&answer, stream, "allow atomic publish on")?;
    tracing::info!(stream = %stream, "stream allows atomic publish (allow_atomic)");
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
