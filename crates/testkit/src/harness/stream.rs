//! What a stream holds, read back.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use pgoutput::Lsn;

/// A message read back from the stream.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub subject: String,
    pub headers: HashMap<String, String>,
    pub payload: Vec<u8>,
    /// When the server stored it, in nanoseconds since the Unix epoch.
    pub published_ns: i128,
}

impl Stored {
    /// The value of header `name`; panics if the message has none.
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(String::as_str)
            .unwrap_or_else(|| panic!("message {} has no {name} header", self.sequence))
    }

    pub fn outbox_id(&self) -> i64 {
        self.header("Outbox-Id")
            .parse()
            .expect("Outbox-Id is an integer")
    }

    pub fn commit_lsn(&self) -> Lsn {
        self.header("Outbox-Commit-Lsn")
            .parse()
            .expect("Outbox-Commit-Lsn is an LSN")
    }

    pub fn tx_index(&self) -> u32 {
        self.header("Outbox-Tx-Index")
            .parse()
            .expect("Outbox-Tx-Index is an integer")
    }
}

/// How long [`read_stream`] waits for the next message from one consumer before it reads on
/// through a new one.
const CONSUMER_STALL: Duration = Duration::from_secs(10);

/// The first `count` messages of `stream`, in stream order, through ephemeral consumers that
/// acknowledge nothing; panics if they do not arrive within `timeout`. A consumer that stops
/// delivering while the stream holds more (seen on a three-node cluster after its stream
/// leader was killed twice, nats-server 2.12.8: the stream's state counted every message and
/// the ephemeral consumer's pull went unanswered) is replaced, after [`CONSUMER_STALL`], by one
/// that starts at the next sequence: what the stream holds is read all the same, and said.
pub async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    count: u64,
    timeout: Duration,
) -> Vec<Stored> {
    let stream = js.get_stream(stream).await.expect("stream exists");
    let mut out: Vec<Stored> = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    let deadline = tokio::time::Instant::now() + timeout;
    while (out.len() as u64) < count {
        let deliver_policy = match out.last() {
            None => jetstream::consumer::DeliverPolicy::All,
            Some(last) => jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: last.sequence + 1,
            },
        };
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                deliver_policy,
                ack_policy: jetstream::consumer::AckPolicy::None,
                inactive_threshold: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .expect("consumer");
        let mut messages = consumer.messages().await.expect("messages");
        while (out.len() as u64) < count {
            let wait = deadline.min(tokio::time::Instant::now() + CONSUMER_STALL);
            let Ok(next) = tokio::time::timeout_at(wait, messages.next()).await else {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "reading the stream timed out: {} of {count} messages read",
                    out.len()
                );
                eprintln!(
                    "testkit: no message from the stream's consumer for {CONSUMER_STALL:?} \
                     with {} of {count} read; reading on through a new consumer",
                    out.len()
                );
                break;
            };
            let message = next.expect("stream ended").expect("message");
            out.push(stored(&message));
        }
    }
    out
}

/// What a test keeps of a message read from the stream.
fn stored(message: &jetstream::Message) -> Stored {
    let info = message.info().expect("jetstream message");
    let (sequence, published_ns) = (info.stream_sequence, info.published.unix_timestamp_nanos());
    let headers: HashMap<String, String> = message
        .headers
        .as_ref()
        .map(|h| {
            h.iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        v.first().map(|v| v.as_str().to_owned()).unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    Stored {
        sequence,
        subject: message.subject.to_string(),
        headers,
        payload: message.payload.to_vec(),
        published_ns,
    }
}

/// The stream's last sequence and, if it has a last message with an outbox position, that
/// message's id and commit LSN; `None` while the stream cannot be read.
pub async fn stream_tail(
    js: &jetstream::Context,
    stream: &str,
) -> Option<(u64, Option<(i64, Lsn)>)> {
    let stream = js.get_stream(stream).await.ok()?;
    let last = stream.cached_info().state.last_sequence;
    if last == 0 {
        return Some((0, None));
    }
    let message = stream.get_raw_message(last).await.ok()?;
    let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_owned());
    let id = header("Outbox-Id").and_then(|v| v.parse().ok());
    let lsn = header("Outbox-Commit-Lsn").and_then(|v| v.parse().ok());
    Some((last, id.zip(lsn)))
}

/// Sets `setting` to `value` in stream `name`'s configuration through the JetStream API's
/// JSON (`STREAM.INFO`'s configuration, changed, to `STREAM.UPDATE`), which keeps the
/// settings async-nats' configuration type lacks (`allow_batched`, `allow_atomic`); panics
/// with the server's answer when it refuses.
pub async fn update_stream_setting(
    js: &jetstream::Context,
    name: &str,
    setting: &str,
    value: serde_json::Value,
) {
    let info: serde_json::Value = js
        .request(format!("STREAM.INFO.{name}"), &serde_json::json!({}))
        .await
        .expect("read the stream's configuration");
    let mut config = info["config"].clone();
    config[setting] = value;
    let answer: serde_json::Value = js
        .request(format!("STREAM.UPDATE.{name}"), &config)
        .await
        .expect("update the stream");
    assert!(answer.get("error").is_none(), "{answer}");
}

/// Publishes `payload` with `headers` to `subject` and waits for the stream's ack (panics
/// when there is none): a message of another writer, or a copy of a stored one.
pub async fn publish_acked(
    js: &jetstream::Context,
    subject: String,
    headers: async_nats::HeaderMap,
    payload: impl Into<bytes::Bytes>,
) {
    js.publish_with_headers(subject, headers, payload.into())
        .await
        .expect("publish")
        .await
        .expect("the stream's ack");
}
