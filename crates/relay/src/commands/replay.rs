//! `outbox-relay replay`: re-publishes a range of outbox rows (`--entity`, `--from-id`,
//! `--to-id`, `--since`, `--until`) for consumers that need them again, and says what it
//! sent and what the stream did with it.
//!
//! How ([`run`]): the range's rows are read in id order (the id column's, `stored` ROW2)
//! through one streaming query; each becomes its event through the builder streaming uses
//! (`outbox` E4, through `crate::postgres::rows::RowReader`, for every mapping and id kind)
//! and its message through `sink::publish_message`, exactly as the relay builds them: same
//! subject, keys, `Nats-Msg-Id` and headers. Rows of an event type the mapping's filter
//! excludes are not published (the relay never published them), and are counted. The table does not know an event's commit position, so the
//! stream is read first (`crate::commands::verify::scan_stream`) for the position of each original;
//! a row without an original on the stream is published with position `0/0`, index 0, and
//! counted. The messages carry no `Outbox-Source`: a relay never takes a replayed message
//! for its own history (`sink::resume` S1).
//!
//! What the stream does with a replay:
//! - inside the stream's duplicate window (from the original's publication), JetStream
//!   acknowledges it as a duplicate and stores nothing;
//! - past it, the copy is stored again, at the stream's end: out of commit order, a second
//!   message for the event (`outbox-relay verify` reports it as duplicated).
//!
//! # Invariants
//! - RP1 Keys and headers are never re-derived: the one builder (`outbox` E4), then
//!   `sink::publish_message`.
//! - RP2 A strict-mode stream (the relay is its only writer: every event once, in commit order)
//!   is refused (exit 2) unless `--force`; with `--force`, replay holds the relay's lease
//!   (`crate::postgres::lease`) for its whole run, and is refused while a relay holds it: a running
//!   strict-mode relay must not publish while another writer does (its pipelined publishes
//!   can line up with the fence again after the other writer's messages and be stored
//!   behind a gap, which its next session then skips: tests/replay.rs reproduced that
//!   loss). A relay started during the replay waits as a standby. Its next session does
//!   not trust the replayed tail (no `Outbox-Source`): it resumes from the slot's confirmed
//!   position and what it publishes again is de-duplicated; nothing is lost (tests/replay.rs).
//! - RP3 At most `max_in_flight` publishes await their ack; any publish error stops the replay
//!   and names the row; the report counts only what JetStream acknowledged.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use outbox::{headers as h, EventId, Lsn, Position};

use crate::commands::verify::{self, shown_id, Bounds, Opened, Param, Range};
use crate::config::{format_duration, Config};
use crate::error::{RelayError, Result};

/// What a replay sent.
#[derive(Debug, Default)]
pub struct Report {
    /// The lowest and highest id sent.
    pub ids: Option<(EventId, EventId)>,
    /// Events published and acknowledged.
    pub published: u64,
    /// Of those, stored again.
    pub stored: u64,
    /// Of those, acknowledged as duplicates (inside the duplicate window): not stored.
    pub duplicates: u64,
    /// Rows without an original on the stream (published with position 0/0).
    pub without_original: u64,
    /// Rows the relay cannot publish either (a NULL key column, an infinite `created_at`),
    /// by id, with why: not sent.
    pub skipped: Vec<(EventId, String)>,
    /// Rows of an event type the mapping's filter excludes: not sent.
    pub excluded: u64,
    /// The stream's duplicate window.
    pub duplicate_window: Duration,
    /// How long it took.
    pub elapsed: Duration,
}

impl Report {
    /// What was sent and what the stream did with it.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (id, why) in &self.skipped {
            out.push_str(&format!("skipped: id={} {why}\n", shown_id(id)));
        }
        if self.excluded > 0 {
            out.push_str(&format!(
                "excluded: {} rows of event types the filter excludes: not sent (the relay never publishes them)\n",
                self.excluded
            ));
        }
        let ids = self.ids.as_ref().map_or_else(
            || "none".to_owned(),
            |(lo, hi)| format!("{}..={}", shown_id(lo), shown_id(hi)),
        );
        out.push_str(&format!(
            "replay: published {} events (ids {ids}) in {:.1} s: {} stored again, {} acknowledged \
             as duplicates and not stored (their originals are inside the stream's duplicate \
             window of {}), {} without an original on the stream (position 0/0), {} skipped\n",
            self.published,
            self.elapsed.as_secs_f64(),
            self.stored,
            self.duplicates,
            format_duration(self.duplicate_window),
            self.without_original,
            self.skipped.len(),
        ));
        out
    }
}

/// Re-publishes the rows of `range` (module docs). `force` allows a strict-mode stream (RP2).
pub async fn run(config: &Config, mut range: Range, force: bool) -> Result<Report> {
    if !config.shared_stream && !force {
        return Err(RelayError::setup(anyhow::anyhow!(
            "stream {} is in strict mode (the relay is its only writer: every event once, in \
             commit order): a replay past the duplicate window stores a second copy at the \
             stream's end, and a running relay's next publish is fenced (it re-syncs; nothing \
             is lost); pass --force to replay anyway, or run the relay and the replay with \
             --shared-stream true",
            config.stream
        )));
    }
    let started = Instant::now();
    let _lease = take_lease(config).await?;
    let opened = verify::open(config, &mut range).await?;
    let duplicate_window = opened
        .stream
        .clone()
        .info()
        .await
        .map(|info| info.config.duplicate_window)
        .map_err(|e| RelayError::permanent(anyhow::anyhow!("cannot read the stream: {e}")))?;
    let mut report = Report {
        duplicate_window,
        ..Report::default()
    };
    let Some(bounds) = &opened.bounds else {
        return Err(crate::postgres::rows::no_rows_in_range(
            &config.table,
            "replay",
        ));
    };
    let positions = original_positions(config, &opened.stream, bounds).await?;
    publish_rows(config, &opened, &positions, &mut report).await?;
    report.elapsed = started.elapsed();
    Ok(report)
}

/// RP2: no relay publishes into a strict-mode stream while the replay does: the slot's
/// lease, held by the connection returned (none for a shared stream).
async fn take_lease(config: &Config) -> Result<Option<tokio_postgres::Client>> {
    Ok(if config.shared_stream {
        None
    } else {
        let lease = replication::connect_sql(&config.database)
            .await
            .map_err(|e| {
                RelayError::permanent(anyhow::anyhow!("cannot connect to Postgres: {e}"))
            })?;
        if !crate::postgres::lease::try_take(&lease, &config.slot).await? {
            let holder = crate::postgres::lease::holder(&lease, &config.slot)
                .await
                .ok()
                .flatten();
            return Err(RelayError::setup(anyhow::anyhow!(
                "a relay holds the lease of slot {}{}: stop it before a forced replay into the \
                 strict-mode stream {} (a strict-mode relay publishing beside another writer \
                 can skip events), then start it again once the replay is done",
                config.slot,
                holder.map_or_else(String::new, |pid| format!(" (backend pid {pid})")),
                config.stream
            )));
        }
        Some(lease)
    })
}

/// The originals' positions: the first event message of each id within `bounds`
/// (dead-letter records aside).
async fn original_positions(
    config: &Config,
    stream: &async_nats::jetstream::stream::Stream,
    bounds: &Bounds,
) -> Result<HashMap<EventId, Position>> {
    let dead_letters = format!("{}.dlq", config.subject_prefix);
    let mut positions: HashMap<EventId, Position> = HashMap::new();
    verify::scan_stream(stream, &config.subject_prefix, |_, message| {
        let Some(headers) = &message.headers else {
            return;
        };
        if message.subject.as_str() == dead_letters {
            return;
        }
        let get = |name: &str| headers.get(name).map(|v| v.as_str());
        let Some(id) = EventId::from_headers(get) else {
            return;
        };
        let get = |name: &str| get(name).unwrap_or("");
        if bounds.contains(&id) {
            if let Some(position) =
                Position::from_headers(get(h::OUTBOX_COMMIT_LSN), get(h::OUTBOX_TX_INDEX))
            {
                positions.entry(id).or_insert(position);
            }
        }
    })
    .await?;

    Ok(positions)
}

/// The rows, in id order, published with a bounded window (R3), each at its original's
/// position (0/0 without one); the outcomes counted into `report`.
async fn publish_rows(
    config: &Config,
    opened: &Opened,
    positions: &HashMap<EventId, Position>,
    report: &mut Report,
) -> Result<()> {
    let reader = &opened.reader;
    let sql = format!(
        "SELECT {} FROM {} WHERE {} ORDER BY {}",
        reader.select(),
        config.table,
        opened.condition,
        reader.order_by()
    );
    let rows = opened
        .client
        .query_raw(&sql, opened.params.iter().map(Param::sql))
        .await
        .map_err(|e| {
            RelayError::permanent(anyhow::anyhow!(
                "cannot read the outbox table: {}",
                crate::postgres::error::describe(&e)
            ))
        })?;
    futures::pin_mut!(rows);
    let mut in_flight = VecDeque::new();
    let window = config.max_in_flight.max(1);
    while let Some(row) = rows.next().await {
        let row = row.map_err(|e| {
            RelayError::permanent(anyhow::anyhow!(
                "cannot read the outbox table: {}",
                crate::postgres::error::describe(&e)
            ))
        })?;
        let Some((id, event)) = event_of(reader, &row, positions, report) else {
            continue;
        };
        let ack = opened
            .js
            .send_publish(event.subject.clone(), sink::publish_message(&event))
            .await
            .map_err(|e| publish_error(&id, e))?;
        report.ids = Some(match report.ids.take() {
            None => (id.clone(), id.clone()),
            Some((lo, _)) => (lo, id.clone()),
        });
        in_flight.push_back((id, ack));
        if in_flight.len() >= window {
            if let Some((id, ack)) = in_flight.pop_front() {
                count(report, &id, ack.await)?;
            }
        }
    }
    while let Some((id, ack)) = in_flight.pop_front() {
        count(report, &id, ack.await)?;
    }
    Ok(())
}

/// The event to replay for `row`, at its original's position (0/0 without one, counted),
/// or `None` when it is not sent: excluded by the filter, or one the relay cannot publish
/// (counted, with why).
fn event_of(
    reader: &verify::RowReader,
    row: &tokio_postgres::Row,
    positions: &HashMap<EventId, Position>,
    report: &mut Report,
) -> Option<(EventId, outbox::OutboxEvent)> {
    let id = reader.id_of(row)?;
    let position = positions.get(&id).copied();
    let mut event = match reader.event(row, position.unwrap_or(ZERO)) {
        Ok(Some(event)) => event,
        Ok(None) => {
            report.excluded += 1;
            return None;
        }
        Err(e) => {
            report.skipped.push((id, e.kind.to_string()));
            return None;
        }
    };
    if position.is_none() {
        report.without_original += 1;
    }
    event.position = position.unwrap_or(ZERO);
    Some((id, event))
}

/// The position of a row without an original on the stream.
const ZERO: Position = Position {
    commit_lsn: Lsn::ZERO,
    index: 0,
};

fn publish_error(id: &EventId, error: impl std::fmt::Display) -> RelayError {
    RelayError::permanent(anyhow::anyhow!(
        "cannot publish outbox row id={}: {error}; the rows before it were sent, rerun the \
         replay from --from-id {}",
        shown_id(id),
        shown_id(id)
    ))
}

fn count(
    report: &mut Report,
    id: &EventId,
    ack: std::result::Result<
        async_nats::jetstream::publish::PublishAck,
        async_nats::jetstream::context::PublishError,
    >,
) -> Result<()> {
    let ack = ack.map_err(|e| publish_error(id, e))?;
    report.published += 1;
    if ack.duplicate {
        report.duplicates += 1;
    } else {
        report.stored += 1;
    }
    Ok(())
}
