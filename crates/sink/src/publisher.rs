//! Publishing to JetStream under a bounded in-flight window, and turning the acks into the
//! watermark the replication stream may confirm.
//!
//! ```text
//!  input (bounded) ─► publisher ──(future, permit)──► acker ─► AckTracker ─► watermark (watch)
//!                       │   send_publish: written          awaits acks in order,
//!                       │   to the connection              one task of its own
//!                       └── window: a semaphore of max_in_flight permits, released by the acker
//! ```
//! Two tasks, because async-nats releases a publish's in-flight slot only once its ack
//! future is resolved or dropped: a single task that both publishes and holds the futures
//! can stall itself.
//!
//! # Invariants
//! - P1 The watermark only moves through [`AckTracker`] (see its A1–A4): a publish that
//!   errors, times out or is dropped never counts as stored; `duplicate: true` does (the
//!   stream already holds the message).
//! - P2 At most `max_in_flight` publishes are unacknowledged at any time; the input channel
//!   is bounded too, so memory is bounded whatever the size of a transaction or backlog.
//! - P3 Any publish or ack error ends [`run`] with that error; nothing after it is
//!   confirmed. Recovery (reconnect, rewind to the confirmed position) is the caller's.
//! - P4 When the input closes, [`run`] drains: it awaits the acks still in flight and
//!   publishes the final watermark before returning.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::{Context, PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::HeaderMap;
use outbox::headers;
use outbox::OutboxEvent;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tracing::debug;

use crate::tracker::{AckTracker, Ticket, TrackerError};

/// What the sink consumes, in replication order.
#[derive(Debug)]
pub enum SinkItem<P> {
    /// A transaction starts.
    Begin,
    /// An outbox row of the open transaction.
    Event(OutboxEvent),
    /// The open transaction committed; `P` is its end position.
    Commit(P),
    /// A position reached with no transaction open (a keepalive's WAL end).
    Idle(P),
}

/// Tuning of [`run`].
#[derive(Debug, Clone, Copy)]
pub struct SinkOptions {
    /// Publishes awaiting their ack at most.
    pub max_in_flight: usize,
}

/// Counters the sink keeps; shared so metrics can read them while it runs.
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Publishes acknowledged as newly stored.
    pub stored: AtomicU64,
    /// Publishes acknowledged as duplicates (JetStream already held the message id).
    pub duplicates: AtomicU64,
}

/// Why the sink stopped.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The publish could not be sent.
    #[error("publishing outbox event id={id} failed: {source}")]
    Publish {
        /// The outbox row id.
        id: i64,
        /// What async-nats reported.
        source: async_nats::jetstream::context::PublishError,
    },
    /// JetStream refused the message, or no ack came in time.
    #[error("JetStream did not store outbox event id={id}: {source}")]
    Ack {
        /// The outbox row id.
        id: i64,
        /// What async-nats reported.
        source: async_nats::jetstream::context::PublishError,
    },
    /// A bug: the items violated the Begin/Event/Commit protocol.
    #[error("replication items out of protocol: {0}")]
    Protocol(#[from] TrackerError),
}

impl SinkError {
    /// The outbox id of an event JetStream will never accept, whatever we retry (an
    /// oversized payload): the caller must stop or dead-letter it, not retry forever.
    pub fn poison_id(&self) -> Option<i64> {
        match self {
            SinkError::Publish { id, source }
                if source.kind() == PublishErrorKind::MaxPayloadExceeded =>
            {
                Some(*id)
            }
            SinkError::Ack { id, source } if is_size_refusal(source) => Some(*id),
            _ => None,
        }
    }
}

fn is_size_refusal(error: &async_nats::jetstream::context::PublishError) -> bool {
    use std::error::Error as _;
    let code = error
        .source()
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
        .map(|e| e.error_code());
    code == Some(async_nats::jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM)
}

/// The JetStream message for an event: its subject's payload and the frozen headers.
pub fn publish_message(event: &OutboxEvent) -> PublishMessage {
    let mut map = HeaderMap::new();
    map.insert(headers::NATS_MSG_ID, event.keys.dedupe_key.as_str());
    map.insert(headers::OUTBOX_ID, event.id.to_string());
    map.insert(headers::OUTBOX_ENTITY_ID, event.entity_id.as_str());
    map.insert(headers::OUTBOX_EVENT_TYPE, event.event_type.as_str());
    map.insert(
        headers::OUTBOX_PARTITION_KEY,
        event.keys.partition_key.as_str(),
    );
    map.insert(
        headers::OUTBOX_ORDERING_KEY,
        event.keys.ordering_key.as_str(),
    );
    map.insert(headers::OUTBOX_SHARD, event.shard.to_string());
    map.insert(headers::OUTBOX_COMMIT_LSN, event.commit_lsn.to_string());
    PublishMessage::build()
        .headers(map)
        .payload(event.payload.clone())
}

enum AckItem<P> {
    Begin,
    Publish {
        id: i64,
        ack: PublishAckFuture,
        _permit: OwnedSemaphorePermit,
    },
    Commit(P),
    Idle(P),
}

/// Publishes `input` until it closes or an error occurs, publishing the confirmable
/// position to `watermark` as acks arrive. See the module docs for the invariants.
pub async fn run<P>(
    jetstream: Context,
    options: SinkOptions,
    mut input: mpsc::Receiver<Vec<SinkItem<P>>>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
) -> Result<(), SinkError>
where
    P: Ord + Copy + Send + Sync + std::fmt::Debug + 'static,
{
    let window = Arc::new(Semaphore::new(options.max_in_flight.max(1)));
    let (ack_tx, ack_rx) = mpsc::channel::<AckItem<P>>(options.max_in_flight.max(1));
    let start = *watermark.borrow();
    let mut acker = tokio::spawn(acker(ack_rx, AckTracker::new(start), watermark, stats));

    let publishing = async {
        while let Some(batch) = input.recv().await {
            for item in batch {
                let item = match item {
                    SinkItem::Begin => AckItem::Begin,
                    SinkItem::Commit(p) => AckItem::Commit(p),
                    SinkItem::Idle(p) => AckItem::Idle(p),
                    SinkItem::Event(event) => {
                        // The semaphore is never closed, so acquire cannot fail.
                        let Ok(permit) = window.clone().acquire_owned().await else {
                            return Ok(());
                        };
                        let ack = jetstream
                            .send_publish(event.subject.clone(), publish_message(&event))
                            .await
                            .map_err(|source| SinkError::Publish {
                                id: event.id,
                                source,
                            })?;
                        AckItem::Publish {
                            id: event.id,
                            ack,
                            _permit: permit,
                        }
                    }
                };
                if ack_tx.send(item).await.is_err() {
                    // The acker stopped: its result says why.
                    return Ok(());
                }
            }
        }
        Ok::<(), SinkError>(())
    };

    let published = tokio::select! {
        result = publishing => result,
        // The acker only ends early on an error; stop publishing at once.
        result = &mut acker => return flatten(result),
    };
    drop(ack_tx);
    match published {
        Ok(()) => flatten(acker.await),
        Err(error) => {
            acker.abort();
            Err(error)
        }
    }
}

fn flatten(result: Result<Result<(), SinkError>, tokio::task::JoinError>) -> Result<(), SinkError> {
    match result {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => Ok(()),
    }
}

async fn acker<P: Ord + Copy + std::fmt::Debug>(
    mut items: mpsc::Receiver<AckItem<P>>,
    mut tracker: AckTracker<P>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
) -> Result<(), SinkError> {
    while let Some(item) = items.recv().await {
        let moved = match item {
            AckItem::Begin => {
                tracker.begin()?;
                None
            }
            AckItem::Commit(end) => tracker.commit(end)?,
            AckItem::Idle(position) => tracker.idle(position),
            AckItem::Publish { id, ack, _permit } => {
                let ticket: Ticket = tracker.publish()?;
                let ack = ack.await.map_err(|source| SinkError::Ack { id, source })?;
                if ack.duplicate {
                    debug!(
                        outbox_id = id,
                        sequence = ack.sequence,
                        "JetStream already held this message id"
                    );
                    stats.duplicates.fetch_add(1, Ordering::Relaxed);
                } else {
                    stats.stored.fetch_add(1, Ordering::Relaxed);
                }
                tracker.ack(ticket)?
            }
        };
        if let Some(position) = moved {
            watermark.send_replace(position);
        }
    }
    Ok(())
}

/// How long to wait for in-flight acks on shutdown, at most.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
