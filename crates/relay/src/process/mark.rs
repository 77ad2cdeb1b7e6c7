//! `--mark-published`: rows whose events JetStream acknowledged are set to `status =
//! 'published'`, `published_at = now()`, `attempts = attempts + 1`, in batches, on an
//! ordinary connection of their own, beside the session: for applications and dashboards
//! that still read the polling publisher's columns.
//!
//! ```text
//!  reader ──ids per commit──► Marking ─(acked: watermark passed them)─► bounded queue ─► marker task
//!    ▲                         (coalesces when the queue is full)                          │ UPDATE … WHERE id = ANY($1::text[]::<type>[])
//!    └───── flush = min(sink watermark, marked) ◄──────────── watch<Lsn> marked ◄───────────┘
//! ```
//!
//! # Invariants
//! - U1 Off the hot path: the reader records the ids of what it hands to the sink and, when
//!   the watermark passes them, offers them to a bounded queue with `try_send`; a full queue
//!   coalesces them into the next offer (24 bytes per id, and a uuid or text id's text).
//!   Nothing the marker does blocks or slows publishing.
//! - U2 Nothing is lost: a failed UPDATE is logged (once per failing spell), counted
//!   (`outbox_relay_mark_failures_total`) and retried after a backoff, on a new connection,
//!   for ever. The session confirms to Postgres the lower of the sink's watermark and the
//!   position through which every acknowledged row is marked, so rows acknowledged but not
//!   yet marked when the relay stops or crashes are replayed by the next session (the sink
//!   skips or de-duplicates them: they are not stored twice) and marked then.
//! - U3 Marking is idempotent: `… AND status IS DISTINCT FROM 'published'`, so a replay
//!   never increments `attempts` twice, and `outbox_relay_marked_total` counts rows once.
//! - U4 No feed-back: the relay's publication publishes inserts only, and the framer ignores
//!   Update messages anyway (a publication that publishes updates re-publishes nothing).
//! - U5 Checked at start ([`check`]): the columns exist with compatible types and the
//!   relay's role may read the id column and `status` and UPDATE the three columns, or the
//!   relay refuses to start (exit 2) naming what is missing and the fix.
//! - U6 The mapping decides the id column (of any kind: the ids go as text, cast to the
//!   column's type read from the catalog, so the primary key's index serves the UPDATE);
//!   `status`, `published_at` and `attempts` keep their names on every table.
//!
//! Every row the sink's watermark passes is marked: events stored earlier and skipped on a
//! replay, and events dead-lettered (`--on-poison dead-letter`: their record is on
//! `{prefix}.dlq`) too. Rows published by a backfill ([`crate::setup::backfill`]) are not marked.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use outbox::{EventId, Item};
use pgoutput::Lsn;
use tokio::sync::{mpsc, watch};
use tokio_postgres::Client;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::config::{Config, Table};
use crate::observe::metrics::Metrics;

/// Ids per UPDATE at most.
pub const MARK_BATCH: usize = 5_000;
/// Offers the queue holds before the reader coalesces (U1).
const QUEUE: usize = 16;

/// Acknowledged ids, and the position through which every acknowledged row is among them
/// or marked before.
#[derive(Debug, Default)]
struct Offer {
    ids: Vec<EventId>,
    through: Lsn,
}

/// The reader's side of the marking (U1, U2): one per session.
#[derive(Debug)]
pub struct Marking {
    queue: mpsc::Sender<Offer>,
    marked: watch::Receiver<Lsn>,
    /// Ids handed to the sink, by the end of their transaction, not yet acknowledged.
    handed: VecDeque<(Lsn, Vec<EventId>)>,
    /// The open transaction's ids, while its commit is not yet handed.
    open: Vec<EventId>,
    /// Acknowledged, not yet queued: the queue was full (U1).
    waiting: Offer,
    /// The highest `through` queued so far.
    offered: Lsn,
    _task: AbortOnDropHandle<()>,
}

impl Marking {
    /// Starts the marker task of a session that starts at `confirmed`.
    pub fn start(config: &Config, confirmed: Lsn, metrics: Arc<Metrics>) -> Marking {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let (marked_tx, marked) = watch::channel(confirmed);
        let task = tokio::spawn(marker(config.clone(), receiver, marked_tx, metrics));
        Marking {
            queue,
            marked,
            handed: VecDeque::new(),
            open: Vec::new(),
            waiting: Offer {
                ids: Vec::new(),
                through: confirmed,
            },
            offered: confirmed,
            _task: AbortOnDropHandle::new(task),
        }
    }

    /// Records the ids of a batch the reader hands to the sink.
    pub fn handed(&mut self, items: &[Item<Lsn>]) {
        for item in items {
            match item {
                Item::Event(event) => self.open.push(event.id.clone()),
                Item::Commit(end) if !self.open.is_empty() => {
                    self.handed
                        .push_back((*end, std::mem::take(&mut self.open)));
                }
                Item::Begin { .. } | Item::Commit(_) | Item::Idle(_) => {}
            }
        }
    }

    /// The sink's watermark moved to `watermark`: what it passed is offered for marking.
    pub fn acknowledged(&mut self, watermark: Lsn) {
        while self
            .handed
            .front()
            .is_some_and(|(end, _)| *end <= watermark)
        {
            if let Some((_, ids)) = self.handed.pop_front() {
                self.waiting.ids.extend(ids);
            }
        }
        self.waiting.through = self.waiting.through.max(watermark);
        self.offer();
    }

    /// Offers what waits, unless the queue is full (then it waits for the next call: U1).
    pub fn offer(&mut self) {
        if self.waiting.through <= self.offered && self.waiting.ids.is_empty() {
            return;
        }
        let offer = Offer {
            ids: std::mem::take(&mut self.waiting.ids),
            through: self.waiting.through,
        };
        match self.queue.try_send(offer) {
            Ok(()) => self.offered = self.waiting.through,
            Err(
                mpsc::error::TrySendError::Full(offer) | mpsc::error::TrySendError::Closed(offer),
            ) => {
                self.waiting.ids = offer.ids;
            }
        }
    }

    /// The position through which every acknowledged row is marked.
    pub fn marked(&self) -> Lsn {
        *self.marked.borrow()
    }

    /// Completes when [`Marking::marked`] moved; `Err` if the marker task is gone.
    pub async fn changed(&mut self) -> std::result::Result<(), watch::error::RecvError> {
        self.marked.changed().await
    }

    /// How many acknowledged ids wait for room in the queue.
    pub fn waiting(&self) -> usize {
        self.waiting.ids.len()
    }
}

/// The marking UPDATE (U3, U6): `id_in` is [`crate::postgres::rows::id_in_text_array`]'s
/// condition, whose `$1` is a `text[]` of ids.
pub fn update_sql(table: &Table, id_in: &str) -> String {
    format!(
        "UPDATE {} SET status = 'published', published_at = pg_catalog.now(), attempts = attempts + 1 \
          WHERE {id_in} AND status IS DISTINCT FROM 'published'",
        table.sql()
    )
}

/// The marker task: takes offers in order (merging what queued up meanwhile), marks their
/// ids in batches of [`MARK_BATCH`], then says through where everything is marked (U2).
async fn marker(
    config: Config,
    mut queue: mpsc::Receiver<Offer>,
    marked: watch::Sender<Lsn>,
    metrics: Arc<Metrics>,
) {
    let mut client: Option<(Client, String)> = None;
    let mut failing = false;
    while let Some(mut offer) = queue.recv().await {
        while let Ok(next) = queue.try_recv() {
            offer.ids.extend(next.ids);
            offer.through = next.through;
        }
        for chunk in offer.ids.chunks(MARK_BATCH) {
            let mut backoff = Duration::from_millis(100);
            loop {
                match mark(&mut client, &config, chunk).await {
                    Ok(rows) => {
                        metrics.marked(rows);
                        if std::mem::take(&mut failing) {
                            info!("marking rows published works again");
                        }
                        break;
                    }
                    Err(error) => {
                        metrics.mark_failed();
                        client = None;
                        if !std::mem::replace(&mut failing, true) {
                            warn!(error = %error, rows = chunk.len(), first_id = chunk.first().map(|id| id.to_string()), metric = "outbox_relay_mark_failures_total",
                                "cannot mark acknowledged rows published; retrying (the slot is not confirmed past them meanwhile)");
                        } else {
                            debug!(error = %error, "marking failed again");
                        }
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(10));
                    }
                }
            }
        }
        let _ = marked.send(offer.through);
    }
}

/// Marks `ids` on the connection in `client` (opened, with its UPDATE, when there is none
/// or it closed).
async fn mark(
    client: &mut Option<(Client, String)>,
    config: &Config,
    ids: &[EventId],
) -> std::result::Result<u64, anyhow::Error> {
    let (connected, sql) = match client {
        Some((connected, sql)) if !connected.is_closed() => (connected, sql),
        _ => {
            // SB1: on a standby the rows are marked on the primary.
            let connected = replication::connect_sql(config.primary()).await?;
            let id_in = crate::postgres::rows::id_in_text_array(&connected, config).await?;
            let sql = update_sql(&config.table, &id_in);
            let (connected, sql) = client.insert((connected, sql));
            (connected, sql)
        }
    };
    let ids: Vec<String> = ids.iter().map(EventId::to_string).collect();
    Ok(connected.execute(sql.as_str(), &[&ids]).await?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: i64) -> Item<Lsn> {
        let row = outbox::OutboxRow::seed(id, "e", "T", bytes::Bytes::from_static(b"{}"), 0);
        Item::Event(row.into_event(
            "outbox",
            std::num::NonZeroU64::MIN,
            outbox::Position {
                commit_lsn: Lsn(0),
                index: 0,
            },
        ))
    }

    #[test]
    fn update_is_idempotent_and_takes_a_text_array_cast_to_the_id_type() {
        let sql = update_sql(
            &crate::config::TableName {
                schema: "public".into(),
                name: "outbox_events".into(),
            }
            .into(),
            "\"id\" = ANY($1::text[]::bigint[])",
        );
        assert!(
            sql.contains("WHERE \"id\" = ANY($1::text[]::bigint[]) AND"),
            "{sql}"
        );
        assert!(sql.contains("status IS DISTINCT FROM 'published'"), "{sql}");
        assert!(sql.contains("attempts = attempts + 1"), "{sql}");
    }

    #[tokio::test]
    async fn u1_acknowledged_ids_are_offered_per_commit_and_coalesced_while_the_queue_is_full() {
        let (queue, mut receiver) = mpsc::channel(1);
        let (_marked_tx, marked) = watch::channel(Lsn(0));
        let mut marking = Marking {
            queue,
            marked,
            handed: VecDeque::new(),
            open: Vec::new(),
            waiting: Offer::default(),
            offered: Lsn(0),
            _task: AbortOnDropHandle::new(tokio::spawn(async {})),
        };
        marking.handed(&[
            Item::Begin { commit_time_us: 0 },
            event(1),
            event(2),
            Item::Commit(Lsn(0x10)),
            Item::Begin { commit_time_us: 0 },
            event(3),
            Item::Commit(Lsn(0x20)),
            Item::Idle(Lsn(0x28)),
            Item::Begin { commit_time_us: 0 },
            event(4),
            Item::Commit(Lsn(0x30)),
        ]);
        marking.acknowledged(Lsn(0x10));
        let first = receiver.try_recv().unwrap();
        let ids = |ids: &[i64]| ids.iter().copied().map(EventId::Int).collect::<Vec<_>>();
        assert_eq!((first.ids, first.through), (ids(&[1, 2]), Lsn(0x10)));
        // The queue holds one offer: the second fills it, the third coalesces.
        marking.acknowledged(Lsn(0x20));
        marking.acknowledged(Lsn(0x30));
        assert_eq!(marking.waiting(), 1, "id 4 waits for room");
        let second = receiver.try_recv().unwrap();
        assert_eq!((second.ids, second.through), (ids(&[3]), Lsn(0x20)));
        marking.offer();
        let third = receiver.try_recv().unwrap();
        assert_eq!((third.ids, third.through), (ids(&[4]), Lsn(0x30)));
        assert_eq!(marking.waiting(), 0);
    }
}
