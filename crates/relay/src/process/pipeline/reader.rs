//! The reader task: the replication stream read, decoded and framed into events, handed to
//! the sink in bounded batches, keepalives answered and the watermark confirmed (I1, I3),
//! under the identity watch's cap (TI2) and the marking's (U2).

use super::*;

/// How the reader stopped (`Err`: the replication stream failed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReaderEnd {
    /// The sink closed its watermark: drained after a shutdown (`intake_open: false`), or
    /// failed while events were flowing.
    SinkEnded { intake_open: bool },
    /// Shutdown, and the drain deadline passed before every in-flight ack arrived.
    DrainDeadlinePassed,
}

/// What one turn of the reader's loop saw.
pub(super) enum Step {
    Shutdown,
    Watermark {
        sink_running: bool,
    },
    /// A cap on the confirmed position moved: the marker marked more or a check of the
    /// table's identity passed (`running: false`: what raises it is gone).
    Cap {
        running: bool,
    },
    Tick,
    Handed,
    Message(std::result::Result<ReplicationMessage, replication::Error>),
}

pub(super) struct Reader {
    /// `--mark-published`: the ids handed to the sink, marked once acknowledged (U1–U3).
    pub(super) marking: Option<crate::process::mark::Marking>,
    /// The LSN the table's identity checks vouched for: nothing past it is confirmed
    /// ([`crate::process::identity`] TI2).
    pub(super) vouched: watch::Receiver<Lsn>,
    pub(super) stream: ReplicationStream,
    pub(super) framer: Framer,
    pub(super) items: Option<mpsc::Sender<Vec<Item<Lsn>>>>,
    pub(super) confirmed: watch::Receiver<Lsn>,
    pub(super) feedback: Feedback,
    /// Items decoded but not yet handed to the sink: at most one batch (I7).
    pub(super) pending: Vec<Item<Lsn>>,
    /// After a shutdown: when the drain gives up.
    pub(super) drain_until: Option<TokioInstant>,
    /// Shared mode: the stream's duplicate window, until the first replayed transaction was
    /// checked against it.
    pub(super) dedupe_guard: Option<Duration>,
    /// Where the reader's positions are shown (once per batch and status update).
    pub(super) metrics: Arc<Metrics>,
}

impl Reader {
    /// Reads until shutdown (then drains) or an error. See I3, I7, I10.
    pub(super) async fn run(
        mut self,
        shutdown: CancellationToken,
        drain_deadline: Duration,
    ) -> Result<ReaderEnd> {
        let watermark = *self.confirmed.borrow_and_update();
        self.on_watermark(watermark);
        // I3: one timer, always set to the moment the next status is due (or the drain
        // deadline). A fixed-period ticker beside a "due" check aliases: a tick that lands a
        // hair before the due time skips a whole period, and the updates end up spaced
        // 2 × interval = wal_sender_timeout apart (the walsender timed out a backpressured
        // relay that way).
        let timer = tokio::time::sleep_until(self.wake_at());
        tokio::pin!(timer);
        loop {
            let wake = self.wake_at();
            if timer.deadline() != wake {
                timer.as_mut().reset(wake);
            }
            let intake_open = self.items.is_some();
            let has_pending = !self.pending.is_empty();
            // Each branch only yields a step; the steps are handled by `on_step`, once the
            // branch futures (which borrow parts of `self`) are dropped.
            let step = tokio::select! {
                biased;
                // PRIORITY 1: shutdown stops intake (cancel-safe: a token wait).
                _ = shutdown.cancelled(), if intake_open => Step::Shutdown,
                // PRIORITY 2: the watermark moved, or the sink ended (drained or failed).
                changed = self.confirmed.changed() => Step::Watermark { sink_running: changed.is_ok() },
                // PRIORITY 2b: a cap moved (U2, TI2: confirmation waits for them).
                changed = cap_changed(&mut self.marking, &mut self.vouched) => Step::Cap { running: changed.is_ok() },
                // PRIORITY 3: status due, or the drain deadline (cancel-safe: a sleep).
                () = &mut timer => Step::Tick,
                // PRIORITY 4: hand the pending batch to the sink (cancel-safe: reserve).
                permit = reserve(&self.items), if intake_open && has_pending => match permit {
                    Some(permit) => {
                        // Size the next batch like this one: a live trickle should not
                        // allocate a 512-item vector per event.
                        let capacity = self.pending.len().clamp(16, MAX_BATCH);
                        permit.send(std::mem::replace(&mut self.pending, Vec::with_capacity(capacity)));
                        Step::Handed
                    }
                    // The sink ended; PRIORITY 2 reports why.
                    None => Step::Handed,
                },
                // PRIORITY 5: new WAL, only while nothing is pending (cancel-safe: recv).
                message = self.stream.recv(), if intake_open && !has_pending => Step::Message(message),
            };
            if let Some(end) = self.on_step(step, intake_open, drain_deadline).await? {
                if end == (ReaderEnd::SinkEnded { intake_open: false }) {
                    // Drained: end the stream politely.
                    if let Err(error) = self.stream.finish().await {
                        debug!(error = %error, "closing the replication stream");
                    }
                }
                return Ok(end);
            }
        }
    }

    /// Handles one step of [`Reader::run`]'s loop; `Some` ends the reader.
    pub(super) async fn on_step(
        &mut self,
        step: Step,
        intake_open: bool,
        drain_deadline: Duration,
    ) -> Result<Option<ReaderEnd>> {
        match step {
            Step::Shutdown => {
                // What is pending was never published: dropping it leaves it unconfirmed.
                info!("shutting down: waiting for in-flight acks");
                self.metrics.set_phase(Phase::ShuttingDown);
                self.items = None;
                self.pending.clear();
                self.drain_until = Some(TokioInstant::now() + drain_deadline);
            }
            Step::Watermark { sink_running: true } => {
                let watermark = *self.confirmed.borrow_and_update();
                self.on_watermark(watermark);
            }
            Step::Cap { running: true } => {
                let watermark = *self.confirmed.borrow();
                if let Some(marking) = &mut self.marking {
                    marking.offer();
                }
                self.on_watermark(watermark);
            }
            Step::Cap { running: false } => {
                return Err(RelayError::transient(anyhow::anyhow!(
                    "the task marking rows published stopped"
                )));
            }
            Step::Watermark {
                sink_running: false,
            } => return self.on_sink_ended(intake_open).await.map(Some),
            Step::Tick => return self.on_tick().await,
            Step::Handed => {}
            Step::Message(message) => self.on_messages(message).await?,
        }
        Ok(None)
    }

    /// The sink is gone: reports its final watermark and stops (after settling what was
    /// marked and vouched for, when drained).
    pub(super) async fn on_sink_ended(&mut self, intake_open: bool) -> Result<ReaderEnd> {
        // The sink is gone: report its final watermark and stop.
        let watermark = *self.confirmed.borrow();
        if !intake_open {
            self.settle_marking(watermark).await;
            self.settle_vouched(watermark).await;
        }
        self.on_watermark(watermark);
        self.send_status().await?;
        if !intake_open {
            info!(confirmed_flush_lsn = %self.feedback.flush_lsn(), "drained; final position confirmed");
        }
        Ok(ReaderEnd::SinkEnded { intake_open })
    }

    /// The timer: the shutdown's drain deadline, and the status update when due.
    pub(super) async fn on_tick(&mut self) -> Result<Option<ReaderEnd>> {
        let now = TokioInstant::now();
        if self.drain_until.is_some_and(|deadline| now >= deadline) {
            warn!(confirmed_flush_lsn = %self.feedback.flush_lsn(), "in-flight acks did not all arrive before the shutdown deadline; they will be replayed");
            self.send_status().await?;
            return Ok(Some(ReaderEnd::DrainDeadlinePassed));
        }
        if self.feedback.due(now) {
            self.send_status().await?;
        }
        Ok(None)
    }

    /// New WAL: `message` and what else the stream has buffered (up to [`MAX_BATCH`]
    /// pending), handed for marking as it is framed.
    pub(super) async fn on_messages(
        &mut self,
        message: std::result::Result<ReplicationMessage, replication::Error>,
    ) -> Result<()> {
        let mut pending = std::mem::take(&mut self.pending);
        let before = pending.len();
        self.on_message(message?, &mut pending).await?;
        while pending.len() < MAX_BATCH {
            match self.stream.try_recv_buffered() {
                Some(message) => self.on_message(message?, &mut pending).await?,
                None => break,
            }
        }
        if let Some(marking) = &mut self.marking {
            marking.handed(&pending[before..]);
        }
        self.pending = pending;
        let excluded = std::mem::take(&mut self.framer.excluded);
        if excluded > 0 {
            self.metrics.excluded(excluded);
        }
        self.metrics.set_received(self.framer.received());
        Ok(())
    }

    /// The sink's watermark is `watermark`: what it passed is offered for marking, and the
    /// position to confirm is the watermark (I1) capped by the LSN the identity checks
    /// vouched for (TI2) and, with `--mark-published`, by the marked position (U2).
    pub(super) fn on_watermark(&mut self, watermark: Lsn) {
        let vouched = *self.vouched.borrow_and_update();
        let flush = match &mut self.marking {
            Some(marking) => {
                marking.acknowledged(watermark);
                watermark.min(marking.marked())
            }
            None => watermark,
        };
        self.feedback.update(flush.min(vouched));
    }

    /// Drained: gives the marker until the drain deadline to mark what the sink
    /// acknowledged; what it did not mark is not confirmed, so the next session replays it
    /// (stored already: skipped or de-duplicated) and marks it (U2).
    pub(super) async fn settle_marking(&mut self, watermark: Lsn) {
        let Some(marking) = &mut self.marking else {
            return;
        };
        let deadline = self
            .drain_until
            .unwrap_or_else(|| TokioInstant::now() + SINK_GRACE);
        marking.acknowledged(watermark);
        while marking.marked() < watermark {
            marking.offer();
            match tokio::time::timeout_at(deadline, marking.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
        if marking.marked() < watermark {
            warn!(marked = %marking.marked(), acknowledged = %watermark,
                "rows acknowledged by JetStream were not all marked published before the shutdown deadline; the slot is confirmed only through the marked ones, so the next session marks the rest");
        }
    }

    /// Drained: gives the identity checks (every [`identity::CHECK_DRAINING`] meanwhile)
    /// until the drain deadline to vouch for the watermark (TI2); what they did not vouch
    /// for is not confirmed, and the next session replays it (stored already: skipped or
    /// de-duplicated).
    pub(super) async fn settle_vouched(&mut self, watermark: Lsn) {
        let deadline = self
            .drain_until
            .unwrap_or_else(|| TokioInstant::now() + SINK_GRACE);
        while *self.vouched.borrow_and_update() < watermark {
            match tokio::time::timeout_at(deadline, self.vouched.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => break,
            }
        }
    }

    /// When the reader's timer must fire next: the status due time (now, if none was sent
    /// yet), or the drain deadline if sooner.
    pub(super) fn wake_at(&self) -> TokioInstant {
        let due = self.feedback.next_due().unwrap_or_else(TokioInstant::now);
        self.drain_until.map_or(due, |deadline| due.min(deadline))
    }

    pub(super) async fn on_message(
        &mut self,
        message: ReplicationMessage,
        pending: &mut Vec<Item<Lsn>>,
    ) -> Result<()> {
        if let ReplicationMessage::PrimaryKeepalive(keepalive) = &message {
            if keepalive.reply_requested {
                self.send_status().await?;
            }
        }
        // A permanent error is printed once, by the binary, when the relay stops.
        self.framer.on_message(message, pending)?;
        for notice in self.framer.take_notices() {
            let Notice::PartitionInsert {
                partition,
                commit_lsn,
            } = notice;
            warn!(
                partition = %partition,
                commit_lsn = %commit_lsn,
                "inserts into a partition arrive under the partition's own name (committed while the publication lacked publish_via_partition_root); relaying them as inserts into the table"
            );
        }
        if let (Some(window), Some(commit_time)) =
            (self.dedupe_guard, self.framer.first_commit_time)
        {
            self.dedupe_guard = None;
            check_dedupe_window(&self.metrics, window, commit_time);
        }
        Ok(())
    }

    pub(super) async fn send_status(&mut self) -> Result<()> {
        self.stream.send_feedback(&mut self.feedback).await?;
        self.metrics.set_confirmed(self.feedback.flush_lsn());
        Ok(())
    }
}

/// Shared mode's guard: the oldest event a session may replay is its first transaction; if
/// it committed longer ago than the stream's duplicate window, replays of events published
/// before the restart are no longer recognised as duplicates.
pub(super) fn check_dedupe_window(
    metrics: &Metrics,
    window: Duration,
    commit_time: pgoutput::copy_data::PgTimestamp,
) {
    let now = replication::pg_timestamp(std::time::SystemTime::now());
    let age = Duration::from_micros(u64::try_from(now.saturating_sub(commit_time)).unwrap_or(0));
    if age > window {
        metrics.record(Event::DedupeWindowExceeded { age, window });
    }
}

/// Completes when a cap on the confirmed position moved: the marker marked more (never
/// without `--mark-published`), or an identity check vouched for more (its sender lives as
/// long as the process's sessions, so only the marker's end is an error).
pub(super) async fn cap_changed(
    marking: &mut Option<crate::process::mark::Marking>,
    vouched: &mut watch::Receiver<Lsn>,
) -> std::result::Result<(), watch::error::RecvError> {
    let marked = async {
        match marking {
            Some(marking) => marking.changed().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        changed = marked => changed,
        changed = vouched.changed() => {
            if changed.is_err() {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    }
}

pub(super) async fn reserve<T>(sender: &Option<mpsc::Sender<T>>) -> Option<mpsc::Permit<'_, T>> {
    sender.as_ref()?.reserve().await.ok()
}
