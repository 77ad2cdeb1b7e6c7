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

/// The first `count` messages of `stream`, in stream order, through an ephemeral consumer
/// that acknowledges nothing; panics if they do not arrive within `timeout`.
pub async fn read_stream(
    js: &jetstream::Context,
    stream: &str,
    count: u64,
    timeout: Duration,
) -> Vec<Stored> {
    let stream = js.get_stream(stream).await.expect("stream exists");
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ack_policy: jetstream::consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut out = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
    let mut messages = consumer.messages().await.expect("messages");
    let deadline = tokio::time::Instant::now() + timeout;
    while (out.len() as u64) < count {
        let next = tokio::time::timeout_at(deadline, messages.next())
            .await
            .expect("reading the stream timed out");
        let message = next.expect("stream ended").expect("message");
        let info = message.info().expect("jetstream message");
        let (sequence, published_ns) =
            (info.stream_sequence, info.published.unix_timestamp_nanos());
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
        out.push(Stored {
            sequence,
            subject: message.subject.to_string(),
            headers,
            payload: message.payload.to_vec(),
            published_ns,
        });
    }
    out
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
