//! Reading: the stream, scanned by an ordered consumer on a thread of its own with the
//! order and tallies it sees, and the table, read in id order beside it.

use super::*;

/// Reads every message of the outbox subjects (`{prefix}.>`, dead-letter records included)
/// once, in stream order, through an ephemeral pull consumer that acknowledges nothing, in
/// large batches; stops at the last message stored when the read caught up. Returns how
/// many messages were read.
pub(crate) async fn scan_stream(
    stream: &jetstream::stream::Stream,
    prefix: &str,
    mut each: impl FnMut(u64, &jetstream::Message),
) -> Result<u64> {
    let mut consumer = scan_consumer(stream, prefix).await?;
    let pending = consumer
        .info()
        .await
        .map_err(|e| nats_error("cannot read the consumer")(Box::new(e)))?
        .num_pending;
    let mut read = 0;
    if pending > 0 {
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(BATCH)
            .messages()
            .await
            .map_err(|e| nats_error("cannot read the stream")(Box::new(e)))?;
        loop {
            let message = match tokio::time::timeout(STREAM_IDLE_TIMEOUT, messages.next()).await {
                Err(_) => {
                    return Err(RelayError::permanent(anyhow::anyhow!(
                        "the stream sent nothing for {} s while messages were pending: check \
                         the NATS server and retry",
                        STREAM_IDLE_TIMEOUT.as_secs()
                    )))
                }
                Ok(None) => break,
                Ok(Some(message)) => {
                    message.map_err(|e| nats_error("cannot read the stream")(Box::new(e)))?
                }
            };
            read += 1;
            let info = message
                .info()
                .map_err(|e| nats_error("a message without JetStream metadata")(e))?;
            let (seq, left) = (info.stream_sequence, info.pending);
            each(seq, &message);
            if left == 0 {
                break;
            }
        }
    }
    let name = consumer.cached_info().name.clone();
    let _ = stream.delete_consumer(&name).await;
    Ok(read)
}

/// The ephemeral pull consumer [`scan_stream`] reads through (VER1: it acknowledges nothing
/// and the server deletes it when idle).
pub(super) async fn scan_consumer(
    stream: &jetstream::stream::Stream,
    prefix: &str,
) -> Result<jetstream::consumer::Consumer<pull::Config>> {
    // A stream that holds `{prefix}.>` only needs no filter: the server then skips matching
    // each message's subject against it.
    let filter = format!("{prefix}.>");
    let filter = if stream.cached_info().config.subjects == [filter.clone()] {
        String::new()
    } else {
        filter
    };
    stream
        .create_consumer(pull::Config {
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            ack_policy: jetstream::consumer::AckPolicy::None,
            filter_subject: filter,
            inactive_threshold: Duration::from_secs(60),
            memory_storage: true,
            ..Default::default()
        })
        .await
        .map_err(|e| nats_error("cannot create a consumer on the stream")(Box::new(e)))
}

/// What reading the stream found: [`Entry`]s by id, and where copies and order went wrong.
pub(super) struct StreamSide {
    /// Messages read.
    pub(super) read: u64,
    pub(super) index: Index,
    /// Ids whose message comes after one committed later, and why.
    pub(super) out_of_order: Vec<(EventId, String)>,
    /// The ids and sequences of second and later copies.
    pub(super) duplicates: Vec<(EventId, u64)>,
    /// Event messages of ours whose ids lie outside the bounds (VER7).
    pub(super) ours_outside: u64,
}

/// The commit order's checks as the stream is read (step 2): per entity, and globally in
/// strict mode (not a shared stream).
///
/// Positions compare only within one WAL history (`Outbox-Source`): after a restore, a
/// major-version upgrade or a fail-over's new history, LSNs start again lower, and the
/// stream's order is still the commit order. Each history gets its own checks; the few
/// sources a stream holds are kept in a list and found by comparison.
#[derive(Default)]
pub(super) struct OrderCheck {
    /// Every message must come after the one before it, not only per entity.
    pub(super) strict: bool,
    pub(super) sources: Vec<String>,
    pub(super) last_global: HashMap<usize, (Position, EventId)>,
    pub(super) per_entity: HashMap<(usize, u64), (Position, EventId)>,
}

impl OrderCheck {
    /// The number of `source`'s history, given when first seen.
    pub(super) fn history(&mut self, source: &str) -> usize {
        match self.sources.iter().position(|s| s == source) {
            Some(history) => history,
            None => {
                self.sources.push(source.to_owned());
                self.sources.len() - 1
            }
        }
    }

    /// Records the first copy of `id` (at `seq`, `position`, entity hash `entity`) and says
    /// why it is out of order, if it is.
    pub(super) fn check(
        &mut self,
        seq: u64,
        id: &EventId,
        position: Position,
        source: &str,
        entity: u64,
        headers: &HeaderMap,
    ) -> Option<String> {
        let at = |p: Position| format!("(commit {}, index {})", p.commit_lsn, p.index);
        let history = self.history(source);
        let key = (history, entity);
        let mut problem = None;
        match self.per_entity.get_mut(&key) {
            Some((previous, previous_id)) if position < *previous => {
                problem = Some(format!(
                    "at sequence {seq}: entity {:?} {} comes after id {} {}, \
                     committed later",
                    Fields::of_message("", headers).entity_id,
                    at(position),
                    shown_id(previous_id),
                    at(*previous)
                ));
            }
            Some(last) => *last = (position, id.clone()),
            None => {
                self.per_entity.insert(key, (position, id.clone()));
            }
        }
        let last_global = self
            .last_global
            .entry(history)
            .or_insert_with(|| (position, id.clone()));
        if (position, id) != (last_global.0, &last_global.1) {
            let (previous, previous_id) = (last_global.0, &last_global.1);
            if self.strict && position <= previous && problem.is_none() {
                problem = Some(format!(
                    "at sequence {seq}: {} is not after the message before it \
                     (id {} {}): the stream's order is not the commit order",
                    at(position),
                    shown_id(previous_id),
                    at(previous)
                ));
            }
        }
        if position > last_global.0 {
            *last_global = (position, id.clone());
        }
        problem
    }
}

/// Step 2's fold: each message of the stream into the [`Index`] (ids in `low..=high` only),
/// the copies and the order. A dead-letter record counts apart from the event (VER3).
pub(super) struct Tally {
    pub(super) bounds: Bounds,
    pub(super) dead_letter_subject: String,
    pub(super) index: Index,
    pub(super) order: OrderCheck,
    pub(super) out_of_order: Vec<(EventId, String)>,
    pub(super) duplicates: Vec<(EventId, u64)>,
    /// [`our_source_suffix`].
    pub(super) ours: String,
    /// Event messages of ours whose ids lie outside the bounds (VER7).
    pub(super) ours_outside: u64,
}

impl Tally {
    pub(super) fn new(config: &Config, bounds: Bounds, ours: String) -> Tally {
        Tally {
            ours,
            ours_outside: 0,
            dead_letter_subject: format!("{}.dlq", config.subject_prefix),
            index: Index::new(&bounds),
            bounds,
            order: OrderCheck {
                strict: !config.shared_stream,
                ..OrderCheck::default()
            },
            out_of_order: vec![],
            duplicates: vec![],
        }
    }

    pub(super) fn message(&mut self, seq: u64, message: &jetstream::Message) {
        let Some(headers) = &message.headers else {
            return;
        };
        let seen = Seen::of(headers);
        let Some(id) = seen.id() else {
            return;
        };
        let ours = seen.source.ends_with(&self.ours);
        if !self.bounds.contains(&id) {
            if ours && message.subject.as_str() != self.dead_letter_subject {
                self.ours_outside += 1;
            }
            return;
        }
        let entry = self.index.get(&id);
        if message.subject.as_str() == self.dead_letter_subject {
            entry.dead_letters = entry.dead_letters.saturating_add(1);
            if entry.count == 0 {
                entry.seq = seq;
            }
            return;
        }
        entry.count = entry.count.saturating_add(1);
        if entry.count > 1 {
            self.duplicates.push((id, seq));
            return;
        }
        let (digest, entity) = seen_digest(message.subject.as_str(), &seen, &message.payload);
        entry.seq = seq;
        entry.digest = digest;
        if ours {
            entry.flags |= OURS;
        }
        if let Some(position) = Position::from_headers(seen.commit_lsn, seen.tx_index) {
            let problem = self
                .order
                .check(seq, &id, position, seen.source, entity, headers);
            self.out_of_order.extend(problem.map(|p| (id, p)));
        }
    }
}

/// Step 2, on the calling thread, with its own NATS connection and a single-threaded
/// runtime: the connection's reader and the consumer then share one thread, so handing a
/// message over costs no thread wake-up (on a multi-threaded runtime that wake-up, a futex
/// call per message, cost as much as the comparison), and the table's side runs on the
/// relay's runtime beside it.
pub(super) fn read_stream(
    config: &Config,
    bounds: Bounds,
    ours: String,
    started: Instant,
) -> Result<StreamSide> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| RelayError::permanent(anyhow::anyhow!("cannot start a runtime: {e}")))?;
    runtime.block_on(async {
        let client = crate::connect::nats::connect(&config.nats)
            .await
            .map_err(|e| RelayError::permanent(anyhow::anyhow!("cannot connect to NATS: {e}")))?;
        let stream = jetstream::new(client)
            .get_stream(&config.stream)
            .await
            .map_err(|e| nats_error("cannot read the stream")(Box::new(e)))?;
        let mut tally = Tally::new(config, bounds, ours);
        let read = scan_stream(&stream, &config.subject_prefix, |seq, message| {
            tally.message(seq, message)
        })
        .await?;
        tracing::info!(
            messages = read,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "read the stream"
        );
        Ok(StreamSide {
            read,
            index: tally.index,
            out_of_order: tally.out_of_order,
            duplicates: tally.duplicates,
            ours_outside: tally.ours_outside,
        })
    })
}

/// Starts step 2 on a thread of its own (see [`read_stream`]); the future answers with what
/// it read.
pub(super) fn spawn_stream_side(
    config: &Config,
    bounds: Bounds,
    ours: String,
    started: Instant,
) -> Result<impl std::future::Future<Output = Result<StreamSide>>> {
    let (send, answer) = tokio::sync::oneshot::channel();
    let stream_config = config.clone();
    std::thread::Builder::new()
        .name("verify-stream".into())
        .spawn(move || {
            let _ = send.send(read_stream(&stream_config, bounds, ours, started));
        })
        .map_err(|e| RelayError::permanent(anyhow::anyhow!("cannot start a thread: {e}")))?;
    Ok(async {
        answer.await.map_err(|_| {
            RelayError::permanent(anyhow::anyhow!(
                "the stream reader stopped without an answer"
            ))
        })?
    })
}

/// What reading the table found: each row as verify expects its message, and why the
/// relay cannot publish the rows it cannot.
pub(super) struct TableSide {
    pub(super) expected: Vec<Expected>,
    pub(super) unpublishable: Vec<(EventId, String)>,
}

/// What row `row` (of the reader's select list and the range's condition, its last column)
/// must be on the stream: not checked when out of range, left out by the slot's creation
/// (VER6) or of an event type the filter excludes, else its event's digest (VER2: the one
/// builder's, `outbox` E4), or why it is unpublishable. Rows come in id order, as
/// `left_out` wants them (integer ids only: a boundary records runs of integers). `None`
/// for a row whose id cannot be read.
pub(super) fn expect_row(
    row: &tokio_postgres::Row,
    reader: &RowReader,
    left_out: &mut crate::postgres::boundary::RunCursor<'_>,
) -> Option<(Expected, Option<String>)> {
    let id = reader.id_of(row)?;
    let in_range: bool = row.get(row.len() - 1);
    let state = if !in_range {
        Expected::OUT_OF_RANGE
    } else if id.as_int().is_some_and(|id| left_out.left_out(id)) {
        Expected::LEFT_OUT
    } else {
        Expected::PUBLISHABLE
    };
    let unchecked = |id, state| Expected {
        id,
        digest: 0,
        state,
    };
    if state != Expected::PUBLISHABLE {
        return Some((unchecked(id, state), None));
    }
    Some(match reader.event(row, NO_POSITION) {
        Ok(Some(event)) => (
            Expected {
                digest: event_digest(&event),
                id,
                state: Expected::PUBLISHABLE,
            },
            None,
        ),
        Ok(None) => (unchecked(id, Expected::EXCLUDED), None),
        Err(e) => (
            unchecked(id, Expected::UNPUBLISHABLE),
            Some(e.kind.to_string()),
        ),
    })
}

/// Starts step 3: the table, in id order, streamed, at the same time as the stream: what
/// each row's message must be. Its own task, so that building the rows' events runs beside
/// the stream's side on a second worker thread.
pub(super) async fn spawn_table_side(
    opened: &Opened,
    config: &Config,
    bounds: &Bounds,
    runs: crate::postgres::boundary::Boundary,
    started: Instant,
) -> Result<impl std::future::Future<Output = Result<TableSide>>> {
    let reader = opened.reader.clone();
    let table = &config.table;
    let sql = format!(
        "SELECT {}, ({}) FROM {table} WHERE {} BETWEEN {} AND {} ORDER BY {}",
        reader.select(),
        opened.condition,
        reader.id_ordered(),
        reader.id_literal(&bounds.low.to_string()),
        reader.id_literal(&bounds.high.to_string()),
        reader.order_by(),
    );
    let rows = opened
        .client
        .query_raw(&sql, opened.params.iter().map(Param::sql))
        .await
        .map_err(read_error("cannot read the outbox table"))?;
    let rows_in_range = bounds.rows;
    let task = tokio::spawn(async move {
        futures::pin_mut!(rows);
        let mut expected: Vec<Expected> =
            Vec::with_capacity(usize::try_from(rows_in_range).unwrap_or(0));
        let mut unpublishable: Vec<(EventId, String)> = vec![];
        let mut left_out = runs.cursor();
        while let Some(row) = rows.next().await {
            let row = row.map_err(read_error("cannot read the outbox table"))?;
            let Some((row, why)) = expect_row(&row, &reader, &mut left_out) else {
                continue;
            };
            unpublishable.extend(why.map(|why| (row.id.clone(), why)));
            expected.push(row);
        }
        tracing::info!(
            rows = expected.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "read the table"
        );
        Ok::<_, RelayError>(TableSide {
            expected,
            unpublishable,
        })
    });
    Ok(async {
        task.await
            .map_err(|e| RelayError::permanent(anyhow::anyhow!("the table reader failed: {e}")))?
    })
}
