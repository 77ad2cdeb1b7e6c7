//! Publishing: the session's [`Publisher`] over its own connection: events framed into
//! write buffers, plain, atomic or fast-ingest batches (P1-P15), the fence's headers, and the
//! messages prepared for each event or dead letter.

use super::*;

/// The publisher's state for one session: what it checks events against, the fence, the
/// frames not yet handed to the writer and the publishes' numbers (P10).
pub(super) struct Publisher<'s, P> {
    pub(super) options: &'s SinkOptions,
    pub(super) stats: &'s SinkStats,
    pub(super) limits: Limits,
    pub(super) fence: Option<Fence>,
    /// P8: events an earlier session found to reuse another event's id.
    pub(super) dead_letter_instead: HashMap<Position, String>,
    /// P11: subjects an earlier session was denied.
    pub(super) denied_subjects: HashMap<String, String>,
    /// The commit LSN's text, formatted once per transaction (none yet: a backfilled row's
    /// commit LSN is 0/0 too).
    pub(super) commit_lsn: (Option<outbox::Lsn>, String),
    /// Frames not yet handed to the writer.
    pub(super) out: Frames,
    /// One message's header block.
    pub(super) block: BytesMut,
    /// The newest publish's number in the session (P10).
    pub(super) sequence: u64,
    pub(super) reply_prefix: String,
    /// P13: the session's atomic batches, in strict mode with [`SinkOptions::atomic`];
    /// P14: its fast batches instead, when `fast`.
    pub(super) batches: Option<Batches<(OutboxEvent, OwnedSemaphorePermit)>>,
    /// B4: transactions to publish one message at a time.
    pub(super) per_message: std::collections::HashSet<outbox::Lsn>,
    /// P14: the batches are fast-ingest ones.
    pub(super) fast: Option<Fast<P>>,
    /// F4: the newest event this session put into a fast batch.
    pub(super) last_fast: Option<Position>,
    /// P15: the newest event this session published.
    pub(super) last_framed: Option<Position>,
    /// P6: the comparison of replayed events with the stream, in strict mode.
    pub(super) vouching: Option<crate::vouch::Vouching>,
    /// P15: which events may be in the stream already.
    pub(super) doubt: Doubt,
    /// P15: the newest publish was in doubt: the next one waits for its answer.
    pub(super) settling: bool,
    /// P15: what the acker's answers left of the stream.
    pub(super) answered: Arc<Answered>,
    /// P2: the window's size.
    pub(super) window_size: usize,
}

/// A session's fast-ingest state (P14).
pub(super) struct Fast<P> {
    /// F4: events up to this one are published one message at a time.
    pub(super) paused_through: Option<Position>,
    /// The session number of the open batch's first message (F5).
    pub(super) first: u64,
    /// The flow the reply subjects ask for.
    pub(super) flow: u64,
    /// F1: the items after the held-back event, handed to the acker after it.
    pub(super) deferred: Vec<AckItem<P>>,
    /// One reply subject.
    pub(super) reply: BytesMut,
    /// The session's batch token (F5), taken from the reply prefix once.
    pub(super) token: String,
    /// F6: while a batch is open, the sequence in it of its newest message sent and the
    /// subject of its first.
    pub(super) open: Option<(u64, String)>,
}

impl<P> Fast<P> {
    /// Writes the reply subject of message `sequence` of the open batch (F5; its commit,
    /// an end-of-batch one, F6) into `reply`, after the session's `prefix`.
    pub(super) fn write_reply(
        &mut self,
        prefix: &str,
        sequence: u64,
        commit: bool,
        end_of_batch: bool,
    ) {
        self.reply.clear();
        self.reply.extend_from_slice(prefix.as_bytes());
        batch::FastReply {
            token: &self.token,
            first: self.first,
            flow: self.flow,
            sequence,
            commit,
            end_of_batch,
        }
        .write(&mut self.reply);
    }
}

impl<'s, P> Publisher<'s, P> {
    pub(super) fn new(
        options: &'s SinkOptions,
        limits: Limits,
        frames: mpsc::Sender<Bytes>,
        reply_prefix: String,
        stats: &'s SinkStats,
        fast: Option<usize>,
    ) -> Self {
        let atomic = options.atomic.filter(|_| options.fence.is_some());
        Publisher {
            options,
            stats,
            limits,
            fence: options
                .fence
                .map(|sequence| Fence::at(sequence).chained(options.id_chain)),
            dead_letter_instead: stats.dead_letter_instead(),
            denied_subjects: stats.denied_subjects(),
            commit_lsn: (None, String::new()),
            out: Frames {
                buffer: BytesMut::with_capacity(FLUSH_BYTES * 2),
                frames,
                timeout: options.ack_timeout,
                last_id: EventId::Int(0),
            },
            block: BytesMut::with_capacity(1024),
            sequence: 0,
            batches: atomic
                .map(|limit| limit.min(options.max_in_flight))
                .or(fast)
                .map(|limit| Batches::new(limit, batch::token(&reply_prefix))),
            per_message: stats.per_message(),
            fast: fast.map(|limit| Fast {
                paused_through: stats.fast_paused_through(),
                first: 0,
                flow: limit.min(usize::from(u16::MAX)) as u64,
                deferred: Vec::new(),
                reply: BytesMut::with_capacity(128),
                token: batch::token(&reply_prefix).to_owned(),
                open: None,
            }),
            last_fast: None,
            last_framed: None,
            reply_prefix,
            vouching: None,
            doubt: Doubt::at_start(
                options.fence,
                options.compare.as_ref().map(|c| c.through),
                stats.failed_through(),
            ),
            settling: false,
            answered: Arc::default(),
            window_size: options.max_in_flight.max(1),
        }
    }

    /// Publishes the input's batches, handing each item to the acker in order, until the
    /// input closes, the server goes into lame-duck mode (P12) or the acker stops (then its
    /// result says why). Frames are handed to the writer after each batch, every
    /// [`FLUSH_BYTES`] and before any wait. F1: a fast batch is committed when the input
    /// has nothing more ready, and when the session stops taking input.
    pub(super) async fn publish_input(
        &mut self,
        input: &mut mpsc::Receiver<Vec<Item<P>>>,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
        lame_duck: &AtomicBool,
    ) -> Result<(), SinkError> {
        while let Some(batch) = input.recv().await {
            // P12: a server in lame-duck mode takes nothing more; what is in flight is
            // acknowledged (the batch is taken again by the next session).
            if lame_duck.load(Ordering::Relaxed) {
                break;
            }
            for item in batch {
                if !self.publish_item(item, ack_tx, window).await? {
                    return Ok(());
                }
            }
            if self.fast.is_some() && input.is_empty() && !self.close_batch(ack_tx).await? {
                return Ok(());
            }
            self.out.flush().await?;
        }
        if self.fast.is_some() {
            self.close_batch(ack_tx).await?;
        }
        Ok(())
    }

    /// Publishes one input item (P13: into the open batch, or closing it first) and hands
    /// what it makes to the acker; `false` when the acker stopped.
    pub(super) async fn publish_item(
        &mut self,
        item: Item<P>,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
    ) -> Result<bool, SinkError> {
        if let Item::Event(event) = &item {
            // P6: already stored.
            if self.vouched(event).await {
                if !self.close_batch(ack_tx).await? {
                    return Ok(false);
                }
                self.stats.skipped.fetch_add(1, Ordering::Relaxed);
                return self.hand(ack_tx, AckItem::Stored).await;
            }
            // P15: alone, once every earlier answer is in; and the first publish after one
            // in doubt too, so that its fence counts only what the stream stored. In atomic
            // transactions (P13) an event in doubt stays in its transaction's batch, which the
            // server stores whole or refuses whole (never a duplicate the fence would count,
            // B4), so no reader sees part of a transaction: the settle comes before the batch.
            if (self.settling || self.in_doubt(event))
                && !self.batch_open()
                && !self.settle(ack_tx, window).await?
            {
                return Ok(false);
            }
            self.settling = self.in_doubt(event);
        }
        let item = match item {
            Item::Event(event) if self.batched(&event) => {
                return self.publish_batched(event, ack_tx, window).await;
            }
            Item::Event(event) => Item::Event(event),
            // F1: a fast batch goes on across transactions; what comes between two of its
            // events reaches the acker after the event before it.
            marker if self.batch_open() && self.fast.is_some() => {
                if let Some(fast) = self.fast.as_mut() {
                    fast.deferred.push(marker_item(marker));
                }
                return Ok(true);
            }
            marker => marker,
        };
        // B1: anything but the next event of the open batch ends it.
        if !self.close_batch(ack_tx).await? {
            return Ok(false);
        }
        let item = match item {
            Item::Event(event) => {
                let Some(permit) = self.permit(window).await? else {
                    return Ok(false);
                };
                self.frame(event, permit, None, false)?
            }
            marker => marker_item(marker),
        };
        self.hand(ack_tx, item).await
    }

    /// Publishes an event into the open batch (P13, P14), committing the batch first when
    /// it is full or, for a fast one, when the window has no room (F1); `false` when the
    /// acker stopped.
    pub(super) async fn publish_batched(
        &mut self,
        event: OutboxEvent,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
    ) -> Result<bool, SinkError> {
        if self.fast.is_some() {
            self.last_fast = Some(event.position);
        }
        // A batch full at the limit commits before its next event waits for room.
        if let Some(((held, permit), batch)) = self.batches.as_mut().and_then(Batches::full) {
            let publish = self.frame(held, permit, batch, false)?;
            if !self.hand_held(ack_tx, publish).await? {
                return Ok(false);
            }
        }
        // F1: a fast batch commits before its next event waits for room, so that every
        // event holding a permit is published (its held-back one too).
        if self.fast.is_some()
            && window.available_permits() == 0
            && !self.close_batch(ack_tx).await?
        {
            return Ok(false);
        }
        let Some(permit) = self.permit(window).await? else {
            return Ok(false);
        };
        let staged = self.batches.as_mut().and_then(|b| b.event((event, permit)));
        if let Some(((event, permit), batch)) = staged {
            let publish = self.frame(event, permit, batch, false)?;
            if !self.hand_held(ack_tx, publish).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether a batch is open (an event is held back).
    #[inline]
    pub(super) fn batch_open(&self) -> bool {
        self.batches.as_ref().is_some_and(Batches::is_open)
    }

    /// Commits the open batch, if any: frames its held-back event as its commit (B7: the
    /// transaction's end, for an atomic one) and hands it to the acker; `false` when the
    /// acker stopped.
    pub(super) async fn close_batch(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
    ) -> Result<bool, SinkError> {
        let Some(((event, permit), batch)) = self.batches.as_mut().and_then(Batches::close) else {
            return Ok(true);
        };
        let tx_end = self.fast.is_none();
        let publish = self.frame(event, permit, batch, tx_end)?;
        self.hand_held(ack_tx, publish).await
    }

    /// Hands a batch's event to the acker, then what waited for it (F1).
    pub(super) async fn hand_held(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        publish: AckItem<P>,
    ) -> Result<bool, SinkError> {
        if !self.hand(ack_tx, publish).await? {
            return Ok(false);
        }
        let deferred = match self.fast.as_mut() {
            Some(fast) if !fast.deferred.is_empty() => std::mem::take(&mut fast.deferred),
            _ => return Ok(true),
        };
        for item in deferred {
            if !self.hand(ack_tx, item).await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// A permit of the window (P2): at once when there is room, else once a publish is
    /// acknowledged ([`Publisher::wait_for_room`]).
    #[inline]
    pub(super) async fn permit(
        &mut self,
        window: &Arc<Semaphore>,
    ) -> Result<Option<OwnedSemaphorePermit>, SinkError> {
        match window.clone().try_acquire_owned() {
            Ok(permit) => Ok(Some(permit)),
            Err(_) => self.wait_for_room(window).await,
        }
    }

    /// Hands `item` to the acker (after a publish, the frames to the writer once they fill
    /// [`FLUSH_BYTES`]); `false` when the acker stopped (its result says why).
    #[inline]
    pub(super) async fn hand(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        item: AckItem<P>,
    ) -> Result<bool, SinkError> {
        if self.out.buffer.len() >= FLUSH_BYTES {
            self.out.flush().await?;
        }
        match ack_tx.try_send(item) {
            Ok(()) => Ok(true),
            Err(mpsc::error::TrySendError::Full(item)) => self.wait_for_acker(ack_tx, item).await,
            Err(mpsc::error::TrySendError::Closed(_)) => Ok(false),
        }
    }

    /// P13, P14: whether `event` goes into a batch (in fast-ingest batches, not one the
    /// stream may hold already, P15; not of a transaction to publish one message at a time,
    /// B4; not at or before where a failed fast session got to, F4). An atomic transaction's
    /// event in doubt stays in its batch (P15).
    #[inline]
    pub(super) fn batched(&self, event: &OutboxEvent) -> bool {
        if self.batches.is_none() || (self.fast.is_some() && self.in_doubt(event)) {
            return false;
        }
        match &self.fast {
            Some(fast) => fast
                .paused_through
                .is_none_or(|paused| event.position > paused),
            None => {
                self.per_message.is_empty()
                    || !self.per_message.contains(&event.position.commit_lsn)
            }
        }
    }

    /// P6: whether the stream holds `event` at its place (`crate::resume` S4).
    #[inline]
    pub(super) async fn vouched(&mut self, event: &OutboxEvent) -> bool {
        let Some(vouching) = &mut self.vouching else {
            return false;
        };
        let holds = vouching.holds(event).await;
        if vouching.ended() {
            self.vouching = None;
        }
        holds
    }

    /// P15: whether the stream may hold `event` already.
    #[inline]
    pub(super) fn in_doubt(&self, event: &OutboxEvent) -> bool {
        self.doubt.covers(event.position)
    }

    /// P15: awaits every earlier answer (the frames handed to the writer, the whole window
    /// back), then sets the fence to the stream's last sequence as the answers left it (a
    /// duplicate consumes none), the id chain started again; once the session stored a
    /// publish as new, nothing is in doubt any more. `false` when the acker stopped.
    pub(super) async fn settle(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        window: &Arc<Semaphore>,
    ) -> Result<bool, SinkError> {
        if !self.close_batch(ack_tx).await? {
            return Ok(false);
        }
        self.out.flush().await?;
        let size = u32::try_from(self.window_size).unwrap_or(u32::MAX);
        let Ok(all) = window.acquire_many(size).await else {
            return Ok(false);
        };
        drop(all);
        if ack_tx.is_closed() {
            return Ok(false);
        }
        let Some(fence) = self.fence.as_mut() else {
            return Ok(true);
        };
        let stored = self
            .answered
            .any
            .load(Ordering::Acquire)
            .then(|| self.answered.last_stored.load(Ordering::Acquire));
        let start = self.options.fence.unwrap_or(0);
        let settled = self.doubt.settle(start, fence.sequence, stored);
        self.doubt = settled.doubt;
        if let Some(sequence) = settled.fence {
            fence.sequence = sequence;
            fence.last_msg_id = None;
        }
        Ok(true)
    }

    /// P2: a permit of the full window, once a publish is acknowledged; `None` never (the
    /// semaphore is never closed). Nothing waits on a frame still in `out`: they are handed
    /// to the writer first.
    pub(super) async fn wait_for_room(
        &mut self,
        window: &Arc<Semaphore>,
    ) -> Result<Option<OwnedSemaphorePermit>, SinkError> {
        self.out.flush().await?;
        Ok(window.clone().acquire_owned().await.ok())
    }

    /// Hands `item` to the acker, whose queue is full; `false` when the acker stopped. The
    /// acker may be awaiting a frame still in `out`: they are handed to the writer first.
    pub(super) async fn wait_for_acker(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
        item: AckItem<P>,
    ) -> Result<bool, SinkError> {
        self.out.flush().await?;
        Ok(ack_tx.send(item).await.is_ok())
    }

    /// Writes `event`'s frame (or its dead-letter record's, P7, P8, P11) into `out` as the
    /// session's next publish, holding a permit of the window (P2), as a message of `batch`
    /// when given (P13: only a batch's commit has a reply subject, B3; P14: every message of
    /// a fast batch has one, F5), marked as its transaction's last event when `tx_end` (B7).
    #[inline]
    pub(super) fn frame(
        &mut self,
        event: OutboxEvent,
        permit: OwnedSemaphorePermit,
        batch: Option<Batch>,
        tx_end: bool,
    ) -> Result<AckItem<P>, SinkError> {
        let (fast, replied) = self.place(batch, tx_end);
        let (id, position, created_at_ms) = (event.id.clone(), event.position, event.created_at_ms);
        self.last_framed = Some(position);
        if self.commit_lsn.0 != Some(position.commit_lsn) {
            self.commit_lsn = (Some(position.commit_lsn), position.commit_lsn.to_string());
        }
        // An empty map answers without hashing.
        let instead = match self.dead_letter_instead.get(&position) {
            Some(reason) => Some((PoisonKind::ReusedId, reason.as_str())),
            None => self
                .denied_subjects
                .get(&event.subject)
                .map(|why| (PoisonKind::Denied, why.as_str())),
        };
        let (subject, payload, dead_letter) = prepare(
            event,
            &self.commit_lsn.1,
            self.options,
            self.limits,
            &mut self.fence,
            instead,
            &mut self.block,
        )?;
        let event = Acknowledged {
            position,
            id,
            created_at_ms,
        };
        if let Some((sequence, commit)) = fast {
            return Ok(self.frame_fast(
                event,
                subject,
                &payload,
                dead_letter,
                permit,
                sequence,
                commit,
            ));
        }
        Ok(self.frame_plain(event, subject, &payload, dead_letter, permit, replied))
    }

    /// Where [`Publisher::frame`]'s event goes: a fast batch's place (its sequence in the
    /// batch and whether it commits the batch, P14: in the reply subject, not the headers),
    /// and whether it is answered (all but an atomic batch's messages before its commit,
    /// B3); the fence's headers are set for it.
    #[inline]
    fn place(&mut self, batch: Option<Batch>, tx_end: bool) -> (Option<(u64, bool)>, bool) {
        let (batch, fast) = match (&self.fast, batch) {
            (Some(_), Some(batch)) => (None, Some((batch.sequence, batch.commit))),
            (_, batch) => (batch, None),
        };
        let replied = batch.as_ref().is_none_or(|batch| batch.commit);
        if let Some(fence) = self.fence.as_mut() {
            fence.batch = batch;
            fence.tx_end = tx_end;
            fence.fast = fast.map(|(sequence, _)| sequence);
        }
        (fast, replied)
    }

    /// [`Publisher::frame`]'s end for a message outside a fast batch: staged without a reply
    /// subject inside an atomic batch, else the session's next numbered publish (P10).
    #[inline]
    fn frame_plain(
        &mut self,
        event: Acknowledged,
        subject: String,
        payload: &[u8],
        dead_letter: bool,
        permit: OwnedSemaphorePermit,
        replied: bool,
    ) -> AckItem<P> {
        if !replied {
            self.out
                .push(&event.id, &subject, None, &self.block, payload);
            return AckItem::Staged {
                event,
                dead_letter,
                subject,
                permit,
            };
        }
        self.sequence += 1;
        let sequence = self.sequence;
        self.out.push(
            &event.id,
            &subject,
            Some((&self.reply_prefix, sequence)),
            &self.block,
            payload,
        );
        AckItem::Publish {
            event,
            dead_letter,
            sequence,
            fast: None,
            subject,
            _permit: permit,
        }
    }

    /// [`Publisher::frame`]'s end for a message of a fast batch (F1–F6): its reply subject
    /// names the batch and its place; the commit is awaited with the stream sequence the
    /// fence predicts for it (F3), the others are staged.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn frame_fast(
        &mut self,
        event: Acknowledged,
        subject: String,
        payload: &[u8],
        dead_letter: bool,
        permit: OwnedSemaphorePermit,
        sequence_in_batch: u64,
        commit: bool,
    ) -> AckItem<P> {
        self.sequence += 1;
        let sequence = self.sequence;
        let Some(fast) = self.fast.as_mut() else {
            unreachable!("frame_fast is called in fast mode only");
        };
        if sequence_in_batch == 1 {
            fast.first = sequence;
        }
        fast.write_reply(&self.reply_prefix, sequence_in_batch, commit, false);
        match (&mut fast.open, commit) {
            (_, true) => fast.open = None,
            (None, false) => fast.open = Some((sequence_in_batch, subject.clone())),
            (Some(open), false) => open.0 = sequence_in_batch,
        }
        self.out
            .push_reply(&event.id, &subject, &fast.reply, &self.block, payload);
        if !commit {
            return AckItem::Staged {
                event,
                dead_letter,
                subject,
                permit,
            };
        }
        // After `prepare`, the fence's sequence is this message's own.
        let expect = self.fence.as_ref().map_or(0, |fence| fence.sequence);
        AckItem::Publish {
            event,
            dead_letter,
            sequence,
            fast: Some((fast.first, expect)),
            subject,
            _permit: permit,
        }
    }

    /// F6: ends the open fast batch, if any, with an end-of-batch commit (a message the
    /// server does not store) to the subject of its first message, and hands its awaited
    /// PubAck to the acker.
    pub(super) async fn end_fast_batch(
        &mut self,
        ack_tx: &mpsc::Sender<AckItem<P>>,
    ) -> Result<(), SinkError> {
        let Some(fast) = self.fast.as_mut() else {
            return Ok(());
        };
        let Some((newest, subject)) = fast.open.take() else {
            return Ok(());
        };
        self.sequence += 1;
        fast.write_reply(&self.reply_prefix, newest + 1, true, true);
        let id = self.out.last_id.clone();
        self.out
            .push_reply(&id, &subject, &fast.reply, EMPTY_HEADERS, b"");
        let item = AckItem::FastEnd {
            sequence: self.sequence,
            first: fast.first,
            // The fence's sequence is the newest message's own.
            expect: self.fence.as_ref().map_or(0, |fence| fence.sequence),
        };
        self.hand(ack_tx, item).await.map(drop)
    }

    /// The session's end once the input is published (`published`) or failed: P4, the acker
    /// drains what is in flight (its queue, `ack_tx`, closed); P12, lame-duck mode ends the
    /// session after that.
    pub(super) async fn finish(
        mut self,
        published: Result<(), SinkError>,
        ack_tx: mpsc::Sender<AckItem<P>>,
        acker: AbortOnDropHandle<Result<(), SinkError>>,
        lame_duck: &AtomicBool,
        server: String,
    ) -> Result<(), SinkError> {
        match published {
            Ok(()) => {
                drop(ack_tx);
                flatten(acker.await).and_then(|()| match lame_duck.load(Ordering::Relaxed) {
                    // P12: everything published is acknowledged; the rest is the next session's.
                    true => Err(SinkError::LameDuck { server }),
                    false => Ok(()),
                })
            }
            // P7 halt stops *at* the poison event: the publishes before it are awaited
            // (stored, and confirmed as far as whole transactions go) before the error ends
            // the run, an open fast batch ended for that (F6). Aborting the acker here would
            // drop them unflushed, and a relay halting on every restart would never deliver
            // the events before the poison one.
            Err(error) if error.poison_id().is_some() => {
                let ended = self.end_fast_batch(&ack_tx).await;
                drop(ack_tx);
                let flushed = self.out.flush().await;
                flatten(acker.await).and(ended).and(flushed).and(Err(error))
            }
            Err(error) => {
                acker.abort();
                Err(error)
            }
        }
    }
}

/// The acker's item for an input item that is not an event.
pub(super) fn marker_item<P>(item: Item<P>) -> AckItem<P> {
    match item {
        Item::Begin { commit_time_us } => AckItem::Begin { commit_time_us },
        Item::Commit(p) => AckItem::Commit(p),
        Item::Idle(p) => AckItem::Idle(p),
        Item::Event(_) => unreachable!("events are published, not marked"),
    }
}

/// Why a session's publishing connection failed, when it did not say.
pub(super) const CONNECTION_CLOSED: &str = "the connection is closed";

/// Bytes of frames the publisher gathers before handing them to the writer, unless it
/// would wait first (then it hands them over at once).
pub(super) const FLUSH_BYTES: usize = 64 * 1024;

/// The publisher's frames not yet handed to the connection's writer (M4).
pub(super) struct Frames {
    pub(super) buffer: BytesMut,
    pub(super) frames: mpsc::Sender<Bytes>,
    pub(super) timeout: Duration,
    /// The newest event in `buffer`, to name in an error.
    pub(super) last_id: EventId,
}

impl Frames {
    /// Appends one `HPUB` frame: its line (with the reply subject `{prefix}{sequence}`, if
    /// any), the header block, the payload.
    pub(super) fn push(
        &mut self,
        id: &EventId,
        subject: &str,
        reply: Option<(&str, u64)>,
        block: &[u8],
        payload: &[u8],
    ) {
        wire::hpub_line_to(&mut self.buffer, subject, reply, block.len(), payload.len());
        self.body(id, block, payload);
    }

    /// [`Frames::push`] with a reply subject written whole (a fast batch's, F5).
    pub(super) fn push_reply(
        &mut self,
        id: &EventId,
        subject: &str,
        reply: &[u8],
        block: &[u8],
        payload: &[u8],
    ) {
        wire::hpub_line_reply(&mut self.buffer, subject, reply, block.len(), payload.len());
        self.body(id, block, payload);
    }

    /// A frame's header block, payload and end, after its line.
    #[inline]
    pub(super) fn body(&mut self, id: &EventId, block: &[u8], payload: &[u8]) {
        self.buffer.extend_from_slice(block);
        self.buffer.extend_from_slice(payload);
        self.buffer.extend_from_slice(b"\r\n");
        self.last_id.clone_from(id);
    }

    /// Hands the frames to the writer. Its queue takes them at once unless it is full (the
    /// connection is behind): only then is a timer armed, bounded by the ack timeout.
    pub(super) async fn flush(&mut self) -> Result<(), SinkError> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = self.buffer.split().freeze();
        let id = &self.last_id;
        let closed = || SinkError::Closed {
            id: id.clone(),
            why: CONNECTION_CLOSED.into(),
        };
        match self.frames.try_send(chunk) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(closed()),
            Err(mpsc::error::TrySendError::Full(chunk)) => {
                match tokio::time::timeout(self.timeout, self.frames.send(chunk)).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(_)) => Err(closed()),
                    Err(_) => Err(SinkError::Publish {
                        id: id.clone(),
                        source: PublishError::new(PublishErrorKind::TimedOut),
                    }),
                }
            }
        }
    }
}
/// Writes `event`'s header block into `block` (the event's own, or its dead-letter record's
/// when it is beyond the limits or `instead` gives a reason to (P7, P8; then `true`)),
/// fenced in strict mode (P5), and returns the subject and payload to publish it with.
/// `commit_lsn` is the event's commit LSN, formatted once per transaction by the caller.
pub(super) fn prepare(
    event: OutboxEvent,
    commit_lsn: &str,
    options: &SinkOptions,
    limits: Limits,
    fence: &mut Option<Fence>,
    instead: Option<(PoisonKind, &str)>,
    block: &mut BytesMut,
) -> Result<(String, Bytes, bool), SinkError> {
    let source = options.source.as_str();
    let hostile = event.is_hostile();
    block.clear();
    let problem = match instead {
        Some((kind, reason)) => Err((kind, reason.to_owned())),
        None => event_block(
            block,
            &event,
            hostile,
            commit_lsn,
            source,
            fence.as_ref(),
            limits,
        ),
    };
    let (subject, payload, msg_id, dead_letter) = match problem {
        Ok(msg_id) => (event.subject, event.payload, msg_id, false),
        Err((kind, reason)) if options.poison == PoisonPolicy::Halt => {
            return Err(SinkError::Poison {
                id: event.id.clone(),
                kind,
                reason,
            })
        }
        Err((_, reason)) => {
            let (payload, msg_id) = dead_letter_block(
                block,
                &event,
                hostile,
                &reason,
                options,
                fence.as_ref(),
                limits,
            )?;
            (options.dead_letter_subject.clone(), payload, msg_id, true)
        }
    };
    if let Some(fence) = fence.as_mut() {
        fence.advance(block.get(msg_id).unwrap_or_default());
    }
    Ok((subject, payload, dead_letter))
}

/// Writes `event`'s own header block into `block` (empty) and returns where its
/// `Nats-Msg-Id` is, or why the event cannot be published as is (P7): a payload that is not
/// UTF-8, or a message beyond the limits.
#[inline]
pub(super) fn event_block(
    block: &mut BytesMut,
    event: &OutboxEvent,
    hostile: bool,
    commit_lsn: &str,
    source: &str,
    fence: Option<&Fence>,
    limits: Limits,
) -> Result<std::ops::Range<usize>, (PoisonKind, String)> {
    // P7: published as is, a text payload must be what consumers can decode (a SQL_ASCII
    // database stores any bytes); a bytea's bytes are published as they are.
    let text = if event.binary {
        Ok("")
    } else {
        std::str::from_utf8(&event.payload)
    };
    if let Err(error) = text {
        return Err((
            PoisonKind::NotUtf8,
            format!(
                "its payload is not valid UTF-8 (from byte {}), so no consumer could decode it",
                error.valid_up_to()
            ),
        ));
    }
    let msg_id = write_event_block(block, event, hostile, commit_lsn, Some(source), fence);
    // M2: the size checked is the size of what is sent.
    limits
        .check(
            block.len() + event.payload.len(),
            event.payload.len(),
            event.subject.len(),
        )
        .map(|()| msg_id)
        .map_err(|(excess, reason)| (PoisonKind::from(excess), reason))
}

/// P7 under [`PoisonPolicy::DeadLetter`]: writes the header block of the dead-letter record
/// in `event`'s place (for `reason`) into `block`, cut to what fits (M3), and returns its
/// payload and where its `Nats-Msg-Id` is; poison when even the record cannot fit.
pub(super) fn dead_letter_block(
    block: &mut BytesMut,
    event: &OutboxEvent,
    hostile: bool,
    reason: &str,
    options: &SinkOptions,
    fence: Option<&Fence>,
    limits: Limits,
) -> Result<(Bytes, std::ops::Range<usize>), SinkError> {
    let subject = options.dead_letter_subject.as_str();
    let (map, payload, cut) = fit_dead_letter(
        event,
        hostile,
        reason,
        &options.source,
        subject,
        fence,
        limits,
    )
    .map_err(|why| SinkError::Poison {
        id: event.id.clone(),
        kind: PoisonKind::DeadLetterTooLarge,
        reason: format!("{reason}; {why}"),
    })?;
    warn!(outbox_id = %event.id, reason = %reason, ?cut, "publishing a dead-letter record in place of the event");
    block.clear();
    Ok((payload, write_map_block(block, &map, fence)))
}
