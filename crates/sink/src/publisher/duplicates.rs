//! Duplicates: a publish JetStream answered as a duplicate, judged against what the
//! stream holds (P8, S6): a reused id is told, never taken as stored.

use super::*;

/// P8: what the acker needs to check a duplicate's original.
pub(super) struct Duplicates {
    pub(super) jetstream: Context,
    pub(super) strict: bool,
    pub(super) poison: PoisonPolicy,
}

impl Duplicates {
    pub(super) fn of(jetstream: &Context, options: &SinkOptions) -> Self {
        Duplicates {
            jetstream: jetstream.clone(),
            strict: options.fence.is_some(),
            poison: options.poison,
        }
    }
}

impl Duplicates {
    /// P11: the server denied publish `id` to `subject` (`why`, its words): the session's
    /// end, by the poison policy; the subject is remembered for the next sessions. A
    /// dead-letter record it denies halts.
    pub(super) fn denied(
        &self,
        id: EventId,
        subject: String,
        why: String,
        dead_letter: bool,
        stats: &SinkStats,
    ) -> SinkError {
        stats
            .denied_subjects
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(subject.clone(), why.clone());
        let reason = if dead_letter {
            format!("the NATS server denies publishing its dead-letter record to {subject}: {why}")
        } else {
            format!("the NATS server denies publishing it to {subject}: {why}")
        };
        match self.poison {
            PoisonPolicy::DeadLetter if !dead_letter => SinkError::Denied { id, subject, why },
            _ => SinkError::Poison {
                id,
                kind: PoisonKind::Denied,
                reason,
            },
        }
    }

    /// Checks that the message JetStream holds under the event's id (`stream`'s message
    /// `sequence`, as the duplicate ack names it) is the same event: the row with the same
    /// id and ordering key (`crate::resume::Claim::is_row`), whatever position it carries
    /// (a replay or a backfill of the row published it without the streamed position).
    /// `Err` when it is another one and strict mode must not go on (P8), or when it cannot
    /// be read.
    pub(super) async fn check(
        &self,
        stream: &str,
        sequence: u64,
        event: &Acknowledged,
        stats: &SinkStats,
    ) -> Result<(), SinkError> {
        let Some(original) = self.original(stream, sequence, &event.id).await? else {
            return Ok(());
        };
        let mark = crate::resume::Mark::of(&original);
        match self.other_event(&mark, sequence, event) {
            None => Ok(()),
            Some((kind, reason)) => self.lost(kind, reason, sequence, event, stats),
        }
    }

    /// Reads `stream`'s message `sequence`, the original of a duplicate of outbox row `id`:
    /// `None` when it is no longer in the stream (deleted or aged out), which leaves nothing
    /// to check.
    pub(super) async fn original(
        &self,
        stream: &str,
        sequence: u64,
        id: &EventId,
    ) -> Result<Option<StreamMessage>, SinkError> {
        let stream = self
            .jetstream
            .get_stream_no_info(stream)
            .await
            .map_err(|e| SinkError::Verify {
                id: id.clone(),
                source: async_nats::jetstream::stream::RawMessageError::with_source(
                    async_nats::jetstream::stream::RawMessageErrorKind::Other,
                    e,
                ),
            })?;
        match stream.get_raw_message(sequence).await {
            Ok(original) => Ok(Some(original)),
            Err(error)
                if error.kind()
                    == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound =>
            {
                warn!(
                    outbox_id = %id,
                    sequence,
                    "JetStream acknowledged this event as a duplicate of a message no longer in the stream (deleted or aged out), so whether it was the same event cannot be checked"
                );
                Ok(None)
            }
            Err(source) => Err(SinkError::Verify {
                id: id.clone(),
                source,
            }),
        }
    }

    /// P8's judgement of the original's `mark` (stream sequence `sequence`): `None` when it
    /// is this row's event, or, in shared mode, another writer's copy of it (no row
    /// identity); otherwise what the event would be lost as, and why.
    pub(super) fn other_event(
        &self,
        mark: &crate::resume::Mark,
        sequence: u64,
        event: &Acknowledged,
    ) -> Option<(PoisonKind, String)> {
        let id = &event.id;
        if mark.claim.is_row(id, event.created_at_ms) {
            // The same row's event: a replay of the relay's own publish, or of `outbox-relay
            // replay`/`backfill`'s.
            debug!(
                outbox_id = %id,
                sequence, "JetStream already held this event"
            );
            return None;
        }
        if !mark.claim.is_anonymous() {
            return Some((PoisonKind::ReusedId, reused_reason(mark, sequence, event)));
        }
        if !self.strict {
            // Shared mode: another writer (e.g. a polling publisher during a migration)
            // published it under the same id; that is what shared mode allows.
            debug!(
                outbox_id = %id,
                sequence,
                "JetStream already held a message with this event's id from another writer"
            );
            return None;
        }
        Some((
            PoisonKind::ForeignDuplicate,
            format!(
                "JetStream acknowledged it as a duplicate of stream sequence {sequence}, a message the relay did not write for it (no Outbox-Id or ordering key): another writer published a message under this event's id within the duplicate window"
            ),
        ))
    }

    /// The event would be lost as `kind` (P8): counted; shared mode warns and goes on,
    /// strict mode halts or, under [`PoisonPolicy::DeadLetter`], ends the session so that
    /// the next one publishes a dead-letter record in its place.
    pub(super) fn lost(
        &self,
        kind: PoisonKind,
        reason: String,
        sequence: u64,
        event: &Acknowledged,
        stats: &SinkStats,
    ) -> Result<(), SinkError> {
        let id = event.id.clone();
        stats.reused_ids.fetch_add(1, Ordering::Relaxed);
        if !self.strict {
            warn!(
                outbox_id = %id,
                sequence,
                metric = REUSED_ID_METRIC,
                reason = %reason,
                "this event is not in the stream: outbox ids were reused (TRUNCATE ... RESTART IDENTITY, or a restored sequence?); move the id sequence past every id relayed"
            );
            return Ok(());
        }
        match self.poison {
            PoisonPolicy::Halt => Err(SinkError::Poison { id, kind, reason }),
            PoisonPolicy::DeadLetter => {
                stats
                    .dead_letter_instead
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(event.position, reason.clone());
                Err(SinkError::ReusedId { id, reason })
            }
        }
    }
}

/// Why a duplicate of another row's message (`mark`, at stream sequence `sequence`) means
/// `event`'s outbox id was reused (P8).
pub(super) fn reused_reason(
    mark: &crate::resume::Mark,
    sequence: u64,
    event: &Acknowledged,
) -> String {
    let theirs = match mark.position {
        Some(p) => format!("commit LSN {}, index {}", p.commit_lsn, p.index),
        None => "no position".to_owned(),
    };
    let here = event.position;
    format!(
        "JetStream acknowledged it as a duplicate of stream sequence {}, another event (outbox id {}, ordering key {}, {theirs}; this one is at commit LSN {}, index {}, ordering key {}): its outbox id was reused within the duplicate window",
        sequence,
        mark.claim.id.as_ref().map_or_else(|| "none".to_owned(), |i| i.to_string()),
        mark.claim.ordering_key.as_deref().unwrap_or("none"),
        here.commit_lsn,
        here.index,
        event.id.ordering_key(event.created_at_ms),
    )
}
