//! A batch through a shard worker: gathered from the pull, decoded, handled in one
//! transaction that records its `dedupe_key`s (C2), acknowledged after the commit, a failing
//! event retried or parked (PK1–PK4), the per-entity order checked.

use super::*;

impl<A: Apply> Worker<A> {
    /// Takes in what has been delivered meanwhile, waiting at most `batch_wait` for a batch
    /// to fill.
    pub(super) async fn gather(&mut self, pull: &mut pull::Stream) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + self.config.batch_wait;
        while self.held.len() < self.config.batch_size {
            let next = match pull.next().now_or_never() {
                Some(next) => next,
                None if self.config.batch_wait.is_zero() => break,
                None => match tokio::time::timeout_at(deadline, pull.next()).await {
                    Ok(next) => next,
                    Err(_) => break,
                },
            };
            self.hold(next)?;
        }
        Ok(())
    }

    /// Takes the next batch from what the shard holds: in stream order, at most
    /// `batch_size`, the message of a failed handler alone, and nothing from a message that
    /// is not a valid event of the shard on (that one is the error, once those before it
    /// are done).
    pub(super) fn take_batch(&mut self) -> Result<Batch, Error> {
        if let Some(sequence) = self.waiting_for {
            if self.held.contains_key(&sequence) {
                self.waiting_for = None;
                self.retry_alone = Some(sequence);
            }
        }
        let mut batch = Batch::default();
        while batch.events.len() < self.config.batch_size {
            let Some(&sequence) = self.held.keys().next() else {
                break;
            };
            if self.retry_alone == Some(sequence) && !batch.events.is_empty()
                || self.recovery.is_some()
            {
                break;
            }
            let Some(message) = self.held.remove(&sequence) else {
                break;
            };
            let decoded = self
                .decode(&message, sequence)
                .map_err(Error::from)
                .and_then(|event| self.check_parkable(&event).map(|()| event));
            match decoded {
                Ok(event) => {
                    batch.messages.push(message);
                    batch.events.push(event);
                }
                Err(error) => {
                    self.held.insert(sequence, message);
                    if batch.events.is_empty() {
                        return Err(error);
                    }
                    break;
                }
            }
            if self.retry_alone == Some(sequence) {
                self.retry_alone = None;
                break;
            }
        }
        Ok(batch)
    }

    /// Decodes and checks a message of the shard (C5).
    pub(super) fn decode(
        &self,
        message: &jetstream::Message,
        stream_sequence: u64,
    ) -> Result<Event, MessageError> {
        let delivered = message
            .info()
            .map(|info| u64::try_from(info.delivered).unwrap_or(0))
            .unwrap_or(0);
        let event = Event::decode(
            message.subject.as_str(),
            message.headers.as_ref(),
            message.payload.clone(),
            stream_sequence,
            delivered,
        )?;
        let computed = outbox::shard_for_key(self.config.partitions, &event.keys.partition_key);
        if event.shard != self.shard || computed != self.shard {
            return Err(MessageError {
                stream_sequence,
                subject: event.subject,
                problem: Problem::WrongShard {
                    published: event.shard,
                    computed,
                    partitions: self.config.partitions.get(),
                },
            });
        }
        Ok(event)
    }

    /// Handles one batch (C1–C3, C8) and answers JetStream for it. Returns the Postgres
    /// error after which the rest of the batch is held to be tried again.
    pub(super) async fn handle_batch(
        &mut self,
        messages: &mut Option<pull::Stream>,
    ) -> Result<Option<tokio_postgres::Error>, Error> {
        let Batch {
            messages: batch,
            events,
        } = self.take_batch()?;
        if batch.is_empty() {
            return Ok(None);
        }
        let (settled, end) = match self.connect_postgres().await {
            Ok(()) => self.apply_batch(&events).await,
            Err(Error::Unavailable(Unavailable::Postgres(error))) => (0, End::Postgres(error)),
            Err(error) => {
                self.put_back(batch, &events);
                return Err(error);
            }
        };
        if *self.stop.borrow() {
            // Unsubscribe before the acks, so that JetStream has nowhere to deliver the
            // shard's next messages once it sees them (C7).
            self.end_pull(messages);
        }
        let mut batch = batch.into_iter();
        for (message, event) in batch.by_ref().take(settled).zip(&events) {
            self.ack(message, event).await;
        }
        let mut rest = batch;
        match end {
            End::All => Ok(None),
            End::Failed { at, error } => {
                let failed = rest.next();
                self.put_back(rest.collect(), &events[at + 1..]);
                match failed {
                    Some(message) => {
                        self.handler_failed(message, &events[at], error, messages)
                            .await
                    }
                    None => Ok(None),
                }
            }
            End::Stopped => {
                self.put_back(rest.collect(), &events[settled..]);
                Ok(None)
            }
            End::Postgres(error) => {
                // The transaction did not commit, or its commit's outcome is unknown: the
                // next attempt finds out through the dedupe keys (C3).
                self.put_back(rest.collect(), &events[settled..]);
                Ok(Some(error))
            }
        }
    }

    /// Acknowledges `message` (of `event`), which committed or was a duplicate.
    pub(super) async fn ack(&mut self, message: jetstream::Message, event: &Event) {
        if let Err(error) = message.ack().await {
            // C1 holds either way: a redelivery finds out through the dedupe key.
            warn!(shard = self.shard, outbox_id = %event.id, %error, "could not acknowledge; the message will be redelivered after ack_wait");
        }
        self.last_acked = Some(message);
    }

    /// The handler failed on `event` (`message`; what came after it is held again): it is
    /// released for a retry after a growing delay, and after `max_attempts` failures
    /// parked (PK1) or the consumer stops, as `on_failure` says.
    pub(super) async fn handler_failed(
        &mut self,
        message: jetstream::Message,
        event: &Event,
        error: String,
        messages: &mut Option<pull::Stream>,
    ) -> Result<Option<tokio_postgres::Error>, Error> {
        let sequence = event.stream_sequence;
        let attempts = match self.failing {
            Some(failing) if failing.stream_sequence == sequence => {
                failing.attempts.saturating_add(1)
            }
            _ => 1,
        };
        self.failing = Some(Failing {
            stream_sequence: sequence,
            attempts,
        });
        self.metrics.failing_attempts(self.shard, attempts);
        if attempts < self.config.max_attempts {
            let retry_in = self.config.retry_delay_after(attempts);
            warn!(shard = self.shard, outbox_id = %event.id, stream_sequence = sequence, attempts, %error, ?retry_in, "handler failed; rolled back, the message will be redelivered");
            self.release(&message, Some(retry_in)).await;
            self.metrics.retried(Retry::Event);
            self.waiting_for = Some(sequence);
            self.retry_alone = None;
            return Ok(None);
        }
        match self.config.on_failure {
            OnFailure::Park => Ok(self.park(message, event, attempts, &error).await),
            OnFailure::Stop => {
                self.put_back(vec![message], std::slice::from_ref(event));
                self.finish(messages).await?;
                Err(HandlerFailed {
                    outbox_id: event.id.clone(),
                    stream_sequence: sequence,
                    entity_id: event.entity_id.clone(),
                    dedupe_key: event.keys.dedupe_key.clone(),
                    attempts,
                    error,
                }
                .into())
            }
        }
    }

    /// PK1: parks an event that failed `max_attempts` times (or acknowledges it when another
    /// consumer processed it meanwhile); a Postgres error puts it back, to be tried again
    /// alone after the backoff.
    async fn park(
        &mut self,
        message: jetstream::Message,
        event: &Event,
        attempts: u32,
        error: &str,
    ) -> Option<tokio_postgres::Error> {
        let sequence = event.stream_sequence;
        match self.park_failed(event, attempts, error).await {
            Ok(parked) => {
                if parked {
                    warn!(shard = self.shard, outbox_id = %event.id, stream_sequence = sequence, entity_id = %event.entity_id, attempts, %error, "handler failed max_attempts times; parked (see docs/consumers.md to re-drive), and its entity's later events are parked behind it");
                } else {
                    debug!(
                        shard = self.shard,
                        outbox_id = %event.id,
                        "processed meanwhile by another consumer; acknowledging"
                    );
                }
                self.ack(message, event).await;
                self.failing = None;
                self.metrics.failing_attempts(self.shard, 0);
                None
            }
            Err(postgres) => {
                // Tried again (alone) after the backoff: the handler first.
                self.put_back(vec![message], std::slice::from_ref(event));
                self.retry_alone = Some(sequence);
                Some(postgres)
            }
        }
    }

    /// Holds `messages` (of `events`) again.
    pub(super) fn put_back(&mut self, messages: Vec<jetstream::Message>, events: &[Event]) {
        for (message, event) in messages.into_iter().zip(events) {
            // A redelivery that came meanwhile is the newer.
            self.held.entry(event.stream_sequence).or_insert(message);
        }
    }

    /// Runs `batch` in as few transactions as it takes (C8): all of it, and after a handler
    /// failure the events before the failing one, which is found by bisection when the
    /// handler does not name it.
    pub(super) async fn apply_batch(&mut self, batch: &[Event]) -> (usize, End) {
        let mut done = 0;
        let mut end = batch.len();
        // The end of the shortest slice from `done` known to fail, and the failure.
        let mut failing: Option<(usize, String)> = None;
        while done < batch.len() {
            let slice = &batch[done..end];
            match self.transact(slice).await {
                Err(error) => return (done, End::Postgres(error)),
                Ok(Tx::Committed(outcome)) => {
                    self.committed(slice, &outcome);
                    done = end;
                    end = match &failing {
                        None => batch.len(),
                        // The failure is after what just committed.
                        Some((failing_end, _)) if failing_end - done > 1 => {
                            done + (failing_end - done) / 2
                        }
                        Some(_) => {
                            let error = failing.take().map(|(_, e)| e).unwrap_or_default();
                            return (done, End::Failed { at: done, error });
                        }
                    };
                }
                Ok(Tx::Stopped {
                    handled,
                    done: outcome,
                }) => {
                    self.committed(&slice[..handled], &outcome);
                    return (done + handled, End::Stopped);
                }
                Ok(Tx::Failed { index, error }) => {
                    bump(&self.stats.handler_failures);
                    self.metrics.failed(Failed::Handler);
                    let (failing_end, next_end) = match index {
                        // Named by the handler: the events before it commit, then it is out.
                        Some(index) => (done + index + 1, done + index),
                        None => (end, done + slice.len() / 2),
                    };
                    if next_end == done {
                        return (done, End::Failed { at: done, error });
                    }
                    debug!(
                        shard = self.shard,
                        trying = next_end - done,
                        "handler failed in a batch; trying the events before the failure"
                    );
                    failing = Some((failing_end, error));
                    end = next_end;
                }
            }
        }
        (done, End::All)
    }

    /// After a commit: the counters, and the hook and ordering check (C6) of each event
    /// handled.
    pub(super) fn committed(&mut self, slice: &[Event], done: &Done) {
        let duplicates = slice.len() - done.handled.len() - done.parked.len();
        self.metrics
            .processed(self.shard, done.handled.len() as u64);
        self.metrics.duplicates(self.shard, duplicates as u64);
        if duplicates > 0 {
            self.stats
                .duplicates
                .fetch_add(duplicates as u64, Ordering::Relaxed);
            debug!(
                shard = self.shard,
                duplicates, "already processed; acknowledging"
            );
        }
        if let Some(&first) = done.parked.first() {
            self.count_parked(Parked::Behind, done.parked.len() as u64);
            warn!(
                shard = self.shard,
                parked = done.parked.len(),
                first_outbox_id = %slice[first].id,
                "parked behind an earlier parked event of their entity, not handled"
            );
        }
        for &index in &done.handled {
            let event = &slice[index];
            if let Some(hook) = &self.after_commit {
                hook(event);
            }
            bump(&self.stats.processed);
            if self
                .failing
                .is_some_and(|f| f.stream_sequence == event.stream_sequence)
            {
                self.failing = None;
                self.metrics.failing_attempts(self.shard, 0);
            }
            self.check_order(event);
        }
    }

    /// C6: reports an event whose ordering key is not above its entity's mark.
    pub(super) fn check_order(&mut self, event: &Event) {
        let order = Mark::of(event);
        if let Some(mark) = self.order.regression(&event.entity_id, &order) {
            bump(&self.stats.out_of_order);
            self.metrics.out_of_order();
            warn!(
                shard = self.shard,
                outbox_id = %event.id,
                stream_sequence = event.stream_sequence,
                ordering_key = %event.keys.ordering_key,
                processed_before = %mark.ordering_key(),
                "out of order: this event's ordering key is not above one its entity already processed"
            );
        }
        self.order.record(&event.entity_id, order);
    }

    /// One transaction over `slice`: its dedupe keys in one statement, the events of parked
    /// entities parked (PK2), the handler for the other new ones in stream order, commit
    /// (C1–C3).
    pub(super) async fn transact(&mut self, slice: &[Event]) -> Result<Tx, tokio_postgres::Error> {
        let Some(connection) = self.client.as_mut() else {
            unreachable!("a batch is handled after connecting");
        };
        let tx = connection.client.transaction().await?;
        let mut tx = Transaction::new(tx, &connection.statements);
        let keys: Vec<&str> = slice
            .iter()
            .map(|event| event.keys.dedupe_key.as_str())
            .collect();
        let fresh = record_keys(&tx, &connection.insert, &keys).await?;
        let target = park::Target {
            config: &self.config,
            shard: self.shard,
            text_ids: self.parked_text_ids,
        };
        let (handled, parked) =
            park::park_behind(&tx, target, &mut self.parked, slice, fresh).await?;
        if handled.is_empty() {
            let tx = tx.into_inner();
            match parked.is_empty() {
                true => tx.rollback().await?,
                false => tx.commit().await?,
            }
            return Ok(Tx::Committed(Done { handled, parked }));
        }
        let events = subset(slice, &handled);
        let started = Instant::now();
        let result = run_handler(&*self.handler, &mut tx, &events, &self.stop).await;
        let handler_time = started.elapsed();
        // Indexes into `events` are turned into indexes into `slice` for the caller.
        match result {
            Ok(()) => {
                tx.into_inner().commit().await?;
                let commit_time = started.elapsed() - handler_time;
                self.metrics
                    .transaction(slice.len(), handler_time, commit_time);
                Ok(Tx::Committed(Done { handled, parked }))
            }
            Err(Failure::Stopped { index }) => {
                let done = Done { handled, parked };
                commit_stopped(tx, &connection.remove, &keys, done, index).await
            }
            Err(Failure::Handler { index, error }) => {
                // A failed rollback leaves nothing committed either.
                let _ = tx.into_inner().rollback().await;
                Ok(Tx::Failed {
                    index: index.map(|i| handled[i]),
                    error,
                })
            }
        }
    }
}

/// Records `keys` in one statement (C2); the indexes of those that were not recorded
/// before. The same event twice in one batch (a replay, a redelivery) is new only once.
pub(super) async fn record_keys(
    tx: &Transaction<'_>,
    insert: &Statement,
    keys: &[&str],
) -> Result<Vec<usize>, tokio_postgres::Error> {
    let mut recorded: HashSet<String> = tx
        .query(insert, &[&keys])
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    Ok((0..keys.len())
        .filter(|&i| recorded.remove(keys[i]))
        .collect())
}

/// The events of `slice` at `indexes` (all of them borrowed).
pub(super) fn subset<'a>(slice: &'a [Event], indexes: &[usize]) -> Cow<'a, [Event]> {
    if indexes.len() == slice.len() {
        Cow::Borrowed(slice)
    } else {
        Cow::Owned(indexes.iter().map(|&i| slice[i].clone()).collect())
    }
}

/// The handler stopped before `done.handled[index]` (the consumer is stopping): the keys
/// of the events it did not handle go, the rest commits.
pub(super) async fn commit_stopped(
    tx: Transaction<'_>,
    remove: &Statement,
    keys: &[&str],
    mut done: Done,
    index: usize,
) -> Result<Tx, tokio_postgres::Error> {
    let unhandled: Vec<&str> = done.handled[index..].iter().map(|&i| keys[i]).collect();
    tx.execute(remove, &[&unhandled]).await?;
    tx.into_inner().commit().await?;
    let end = done.handled[index];
    done.handled.truncate(index);
    // Parked ones after `end` are settled with the rest, as duplicates.
    done.parked.retain(|&i| i < end);
    Ok(Tx::Stopped { handled: end, done })
}

/// Runs the handler on `events` in `tx`; a panic is a failure naming no event.
pub(super) async fn run_handler<A: Apply>(
    handler: &A,
    tx: &mut Transaction<'_>,
    events: &[Event],
    stop: &watch::Receiver<bool>,
) -> Result<(), Failure> {
    match AssertUnwindSafe(handler.apply(tx, events, stop))
        .catch_unwind()
        .await
    {
        Ok(result) => result,
        Err(panic) => Err(Failure::Handler {
            index: None,
            error: format!("handler panicked: {}", panic_message(&*panic)),
        }),
    }
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
