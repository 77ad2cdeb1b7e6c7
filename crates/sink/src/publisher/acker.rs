//! The acker: JetStream's answers awaited in publish order, turned into the tracker's
//! watermark (A1-A4) and the transaction clock (L1-L3).

use super::*;

pub(super) fn flatten(
    result: Result<Result<(), SinkError>, tokio::task::JoinError>,
) -> Result<(), SinkError> {
    match result {
        Ok(result) => result,
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => Ok(()),
    }
}

pub(super) async fn acker<P: Ord + Copy + std::fmt::Debug>(
    items: mpsc::Receiver<AckItem<P>>,
    acks: Acks,
    tracker: AckTracker<P>,
    watermark: watch::Sender<P>,
    stats: Arc<SinkStats>,
    answered: Arc<Answered>,
    duplicates: Duplicates,
) -> Result<(), SinkError> {
    let clock = stats.timing.then(|| {
        TxnClock::new(
            &stats.commit_to_ack,
            &stats.created_to_ack,
            &stats.oldest_unconfirmed_us,
        )
    });
    let acker = Acker {
        acks,
        tracker,
        watermark,
        stats: &stats,
        answered,
        duplicates,
        clock,
        staged: Vec::new(),
    };
    acker.run(items).await
}

/// The acker task's state: the answers (P10), the tracker the watermark moves through (P1),
/// the counters (P9) and the transactions' clock when timed.
pub(super) struct Acker<'s, P> {
    pub(super) acks: Acks,
    pub(super) tracker: AckTracker<P>,
    pub(super) watermark: watch::Sender<P>,
    pub(super) stats: &'s SinkStats,
    /// P15: the stream's last sequence as the answers left it.
    pub(super) answered: Arc<Answered>,
    pub(super) duplicates: Duplicates,
    pub(super) clock: Option<TxnClock<'s>>,
    /// The open atomic batch's messages before its commit, with their tickets (B3).
    pub(super) staged: Vec<StagedEvent>,
}

/// A message of an atomic batch awaiting its commit's answer (B3).
pub(super) struct StagedEvent {
    pub(super) ticket: Ticket,
    pub(super) event: Acknowledged,
    pub(super) dead_letter: bool,
    pub(super) subject: String,
    /// Released with the commit's answer (P2).
    pub(super) _permit: OwnedSemaphorePermit,
}

impl<P: Ord + Copy + std::fmt::Debug> Acker<'_, P> {
    /// Takes the publisher's items in order, awaiting each publish's ack, and publishes the
    /// watermark whenever the tracker moves it, until the publisher is done (P4) or an
    /// error ends the session (P3).
    pub(super) async fn run(
        mut self,
        mut items: mpsc::Receiver<AckItem<P>>,
    ) -> Result<(), SinkError> {
        loop {
            let item = match items.try_recv() {
                Ok(item) => item,
                Err(mpsc::error::TryRecvError::Disconnected) => break,
                Err(mpsc::error::TryRecvError::Empty) => tokio::select! {
                    biased;
                    item = items.recv() => match item {
                        Some(item) => item,
                        None => break,
                    },
                    // CN3: a connection that closes while the session is idle ends it now.
                    end = self.acks.closed() => return Err(end),
                },
            };
            let moved = match item {
                AckItem::Publish {
                    event,
                    dead_letter,
                    sequence,
                    fast,
                    subject,
                    // Released once the ack is in (P2).
                    _permit,
                } => {
                    self.acknowledge(event, dead_letter, sequence, fast, subject)
                        .await?
                }
                AckItem::Staged {
                    event,
                    dead_letter,
                    subject,
                    permit,
                } => self.stage(event, dead_letter, subject, permit)?,
                AckItem::FastEnd {
                    sequence,
                    first,
                    expect,
                } => self.fast_end(sequence, first, expect).await?,
                AckItem::Begin { commit_time_us } => self.begin(commit_time_us)?,
                AckItem::Stored => self.stored()?,
                AckItem::Commit(end) => self.commit(end)?,
                AckItem::Idle(position) => self.tracker.idle(position),
            };
            if let Some(position) = moved {
                self.watermark.send_replace(position);
            }
        }
        Ok(())
    }

    /// A transaction's start (with events, P9's clock).
    #[inline]
    pub(super) fn begin(&mut self, commit_time_us: i64) -> Result<Option<P>, SinkError> {
        self.tracker.begin()?;
        if let Some(clock) = &mut self.clock {
            clock.begin(commit_time_us);
        }
        Ok(None)
    }

    /// A message of an atomic batch (B3): registered, acknowledged with its commit.
    #[inline]
    pub(super) fn stage(
        &mut self,
        event: Acknowledged,
        dead_letter: bool,
        subject: String,
        permit: OwnedSemaphorePermit,
    ) -> Result<Option<P>, SinkError> {
        let ticket = self.tracker.publish()?;
        if let Some(clock) = &mut self.clock {
            clock.awaiting();
        }
        self.staged.push(StagedEvent {
            ticket,
            event,
            dead_letter,
            subject,
            _permit: permit,
        });
        Ok(None)
    }

    /// The batch whose commit (outbox row `id`) JetStream refused (`error`): a message of it
    /// to a denied subject is P11's denial; a stored message id makes its transaction one to
    /// publish message by message (B4). Either way nothing of the batch counts as stored.
    pub(super) fn refused(&mut self, id: EventId, error: SinkError) -> SinkError {
        let staged = std::mem::take(&mut self.staged);
        let denied = staged.iter().find_map(|message| {
            self.acks
                .denied
                .iter()
                .find(|(subject, _)| *subject == message.subject)
                .map(|(_, why)| (message, why.clone()))
        });
        if let Some((message, why)) = denied {
            return self.duplicates.denied(
                message.event.id.clone(),
                message.subject.clone(),
                why,
                message.dead_letter,
                self.stats,
            );
        }
        if error.jetstream_code() == Some(batch::DUPLICATE_IN_BATCH) {
            if let Some(first) = staged.first() {
                warn!(
                    outbox_id = %id,
                    commit_lsn = %first.event.position.commit_lsn,
                    "JetStream refused an atomic batch of this transaction: the stream already holds one of its message ids; the next session publishes the transaction one message at a time, where each duplicate is checked"
                );
                self.stats
                    .per_message
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(first.event.position.commit_lsn);
            }
        }
        error
    }

    /// The commit's answer came: every message of its batch is stored (B3); counted (P9)
    /// and acknowledged (P1).
    pub(super) fn stored_with_commit(&mut self) -> Result<Option<P>, SinkError> {
        let mut moved = None;
        for message in std::mem::take(&mut self.staged) {
            let counter = if message.dead_letter {
                self.stats.poison.fetch_add(1, Ordering::Relaxed);
                &self.stats.dead_lettered
            } else {
                &self.stats.stored
            };
            counter.fetch_add(1, Ordering::Relaxed);
            if let Some(clock) = &mut self.clock {
                clock.acked(message.event.created_at_ms);
            }
            moved = self.tracker.ack(message.ticket)?.or(moved);
        }
        Ok(moved)
    }

    /// F6: awaits the answer to an end-of-batch commit (publish `sequence`, of the batch
    /// whose first message is publish `first`), which must be at stream sequence `expect`
    /// (F3); then every staged message is stored.
    pub(super) async fn fast_end(
        &mut self,
        sequence: u64,
        first: u64,
        expect: u64,
    ) -> Result<Option<P>, SinkError> {
        let Some((newest, subject)) = self
            .staged
            .last()
            .map(|message| (message.event.clone(), message.subject.clone()))
        else {
            return Ok(None);
        };
        let answer = self.answer(sequence, Some((first, expect)), &newest.id, &subject);
        if let Err(why) = answer.await? {
            let source = PublishError::with_source(PublishErrorKind::Other, why);
            return Err(self.refused(
                newest.id.clone(),
                SinkError::Ack {
                    id: newest.id,
                    source,
                },
            ));
        }
        let moved = self.stored_with_commit()?;
        self.answered.stored(expect);
        Ok(moved)
    }

    /// The answer to publish `sequence` (outbox row `id`, to `subject`; a fast batch's
    /// commit when `fast`, checked by F3 and counted); an error while a batch's messages
    /// are staged refuses them all. `Ok(Err(why))`: the server denied it (P11).
    pub(super) async fn answer(
        &mut self,
        sequence: u64,
        fast: Option<(u64, u64)>,
        id: &EventId,
        subject: &str,
    ) -> Result<Result<Acked, String>, SinkError> {
        let first = fast.map_or(sequence, |(first, _)| first);
        let answer = self.acks.next(first, sequence, id, subject).await;
        let answer = match fast_checked(answer, fast, id, self.stats) {
            Err(error) if !self.staged.is_empty() => return Err(self.refused(id.clone(), error)),
            answer => answer?,
        };
        if fast.is_some() {
            self.stats.fast_batches.fetch_add(1, Ordering::Relaxed);
        }
        Ok(answer)
    }

    /// An event already stored (P6): acknowledged without a publish.
    #[inline]
    pub(super) fn stored(&mut self) -> Result<Option<P>, SinkError> {
        if let Some(clock) = &mut self.clock {
            clock.awaiting();
        }
        let ticket = self.tracker.publish()?;
        Ok(self.tracker.ack(ticket)?)
    }

    /// A transaction's end, at `end`.
    #[inline]
    pub(super) fn commit(&mut self, end: P) -> Result<Option<P>, SinkError> {
        if let Some(clock) = &mut self.clock {
            clock.commit();
        }
        Ok(self.tracker.commit(end)?)
    }

    /// Awaits the ack of publish `sequence` (`event`'s, or its dead-letter record's), checks
    /// a duplicate (P8), counts it (P9) and hands it to the tracker (P1).
    #[inline]
    pub(super) async fn acknowledge(
        &mut self,
        event: Acknowledged,
        dead_letter: bool,
        sequence: u64,
        fast: Option<(u64, u64)>,
        subject: String,
    ) -> Result<Option<P>, SinkError> {
        let stats = self.stats;
        let ticket: Ticket = self.tracker.publish()?;
        if let Some(clock) = &mut self.clock {
            clock.awaiting();
        }
        let answer = self.answer(sequence, fast, &event.id, &subject).await?;
        // B3: the commit's answer is every staged message's (a denied commit is P11's below).
        let earlier = match self.staged.is_empty() || answer.is_err() {
            true => None,
            false => self.stored_with_commit()?,
        };
        let ack = match answer {
            Ok(ack) => ack,
            Err(why) => {
                let denied =
                    self.duplicates
                        .denied(event.id.clone(), subject, why, dead_letter, stats);
                return Err(denied);
            }
        };
        if ack.duplicate {
            stats.duplicates.fetch_add(1, Ordering::Relaxed);
            self.duplicates
                .check(&ack.stream, ack.sequence, &event, stats)
                .await?;
        } else if dead_letter {
            stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            stats.poison.fetch_add(1, Ordering::Relaxed);
        } else {
            stats.stored.fetch_add(1, Ordering::Relaxed);
        }
        if !ack.duplicate {
            // P15: before the permit is released, so a publisher awaiting every answer sees
            // it.
            self.answered.stored(ack.sequence);
        }
        if let Some(clock) = &mut self.clock {
            clock.acked(event.created_at_ms);
        }
        Ok(self.tracker.ack(ticket)?.or(earlier))
    }
}
