//! Atomic transactions (`--atomic-transactions`): each Postgres transaction is published as
//! one JetStream atomic batch (nats-server 2.12+, a stream with `allow_atomic`), so the
//! stream holds all of its events or none, and a consumer never reads half of one.
//!
//! What nats-server allows in a batch (`server/stream.go`
//! `processJetStreamAtomicBatchMsg`, `server/jetstream_batching.go`, read at the v2.15
//! line): every message carries `Nats-Batch-Id` (at most 64 bytes) and
//! `Nats-Batch-Sequence` (1, 2, … without a gap, or the batch is abandoned); the last one
//! carries `Nats-Batch-Commit: 1`, and the server checks and stores the whole batch when it
//! arrives. Only the first message may carry `Nats-Expected-Last-Sequence` (checked against
//! the stream's last sequence at commit); `Nats-Expected-Last-Msg-Id` is refused in a batch
//! (JSAtomicPublishUnsupportedHeaderBatch). A `Nats-Msg-Id` already staged in the batch or
//! already in the stream's duplicate window rejects the whole batch (10201,
//! JSAtomicPublishContainsDuplicateMessage): a replayed batch is refused, never
//! acknowledged as a duplicate. At most 1 000 messages per batch by default
//! (`jetstream: { limits: { max_batch_size } }`). A message with a reply subject is answered
//! with an empty message when staged; one without is not, and the commit's answer (a
//! PubAck with `"batch"` and `"count"`, or the error that abandoned the batch) speaks for
//! the whole batch.
//!
//! # Invariants
//! - B1 A transaction's events are published as consecutive batches of at most the limit
//!   ([`Batches`]): a transaction of at most the limit is exactly one batch; a larger one is
//!   split at the limit (atomic up to the limit, docs/guarantees.md). A batch is committed
//!   only by its transaction's end or by reaching the limit, never because the input paused
//!   or closed: a session that ends inside a transaction leaves its batch uncommitted, and
//!   the server abandons it (nothing of it is stored).
//! - B2 Strict mode only: the batch's first message carries `Nats-Expected-Last-Sequence`,
//!   the stream's last sequence plus every message the session published before the batch
//!   (`crate::message::Fence`). If a publish before it was lost or refused, the batch is
//!   refused, and so every later one (each expects a sequence that counts the refused
//!   ones). No message of a batch carries the id chain (the server refuses it): see
//!   docs/guarantees.md for what that leaves when another writer breaks strict mode's rule.
//! - B3 Only a batch's commit message has a reply subject (`crate::publisher` P10): the
//!   others are answered by nothing; the commit's answer acknowledges every event of the
//!   batch at once, and until it comes none of them counts as stored (P1). The window
//!   (P2) counts every message of an uncommitted batch, so the limit is at most the window.
//! - B4 A batch refused because it holds a message id the stream already has (10201) is
//!   never taken as stored: the session ends, the next one skips what the stream's tail
//!   shows stored (S4), and publishes the refused transaction's events one message at a
//!   time (per-message mode, where P8 judges each duplicate), for the life of the process.
//! - B5 Batch ids are unique per session (the session's reply token and the batch's
//!   number), so a batch an earlier session left uncommitted never mixes with a new one.
//! - B6 A batch of one message (a one-event transaction, or the last event of a larger
//!   one after a batch at the limit) is published as a plain message, with the whole fence
//!   of P5 (the id chain too): one message is stored whole or not at all anyway, and
//!   nats-server's atomic batch costs it about 1 ms of CPU per batch on a one-replica file
//!   stream (it opens and removes a file store of its own for each batch; measured on
//!   2.15.1, docs/performance.md).
//! - B7 The event a transaction ends with carries `Outbox-Tx-End: 1`
//!   ([`outbox::headers::OUTBOX_TX_END`]): the commit of its last batch, or the one message
//!   after a batch at the limit (B6). No other message does: not a batch cut at the limit,
//!   not a transaction published one message at a time (B4). So the last event of every
//!   batch, at the limit too, is held back until the next item says whether the
//!   transaction goes on. A reader of the whole stream therefore knows a transaction whole
//!   when it reads that event, without waiting for the next transaction
//!   (`outbox_consumer::whole`).
//!
//! # Fast-ingest batches
//! The publish mode a current server makes cheaper (nats-server 2.14+, a stream with
//! `allow_batched`, strict mode on a one-replica stream; the relay selects it, sink
//! `SinkOptions::fast`): consecutive events, across transactions, are published as
//! fast-ingest batches, each message stored as it arrives, answered only now and then
//! (flow control) and the batch's last by a PubAck. What nats-server does with them
//! (`server/stream.go` `processJetStreamFastBatchMsg`, `server/jetstream_batching.go`, read at
//! 1787eee03): the batch's id, initial flow, gap mode, sequence and operation travel in the
//! reply subject (`<prefix>.<id>.<flow>.<gap>.<seq>.<op>.$FI`; op 0 start, 1 append, 2
//! commit); each message is checked as a plain publish is (a fresh check per message:
//! `Nats-Expected-Last-Sequence` on every one, and `Nats-Expected-Last-Msg-Id`, checked
//! where the message is stored); in gap mode `fail`, a message refused or missing ends the
//! batch at once (a PubAck for what was stored, on that message's reply subject; later
//! messages of the batch are refused as of an unknown batch); a message whose id the stream
//! holds is skipped without a word (its PubAck is the previous message's sequence).
//! - F1 A fast batch is at most [`FAST_BATCH_LIMIT`] messages and half the window; it is
//!   committed when the input has nothing more ready, at the limit, before its next event
//!   waits for room in the window, or before any event that is not batched: its last event
//!   is held back ([`Batches`]), as for atomic ones. A transaction's end does not end the
//!   batch: the items between two events (a transaction's commit and the next one's begin)
//!   reach the acker after the event before them, never before it (P1: a commit position
//!   never overtakes its events).
//! - F2 Strict mode's fence: every message carries `Nats-Expected-Last-Sequence`, and the
//!   batch's first message also the id chain when the session chains (P5); gap mode is
//!   `fail`. So nothing after a message that was not stored is stored in its batch (the
//!   server ends it), and a later batch is refused at its first message.
//! - F3 Nothing of a fast batch counts as stored before its commit's PubAck, and then only
//!   if its sequence is the one the fence predicts for the commit (no message of the batch
//!   was a skipped duplicate, none refused); any other answer to any message of the batch
//!   ends the session, and nothing of the batch is confirmed. Flow-control answers are
//!   read and dropped by the connection (`crate::conn`).
//! - F4 After a session with fast batches ends in an error, the next sessions publish one
//!   message at a time up to the newest event that session batched (where P8 judges each
//!   duplicate, P11 each denial), then fast again; a server that refuses fast batches
//!   themselves (batch publish disabled, pattern or id invalid) turns the mode off for the
//!   process's life, with a warning.
//! - F5 Batch ids are the session's token and the session number of the batch's first
//!   message (unique per session, within the server's 64 bytes): an answer's reply subject
//!   gives the publish it answers (P10), the batch's first plus its sequence less one.
//! - F6 A session that halts on a poison event (P7) with a fast batch open ends the batch
//!   with an end-of-batch commit (op 3: a message the server does not store, which commits
//!   what came before it) and awaits its PubAck like any commit's (F3), so that what the
//!   batch stored before the poison event is acknowledged and confirmed as far as whole
//!   transactions go, as in per-message mode.

/// One message's place in an atomic batch: its headers (`crate::message::Fence`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// `Nats-Batch-Id`.
    pub id: String,
    /// `Nats-Batch-Sequence`, from 1.
    pub sequence: u64,
    /// `Nats-Batch-Commit: 1`: the batch's last message.
    pub commit: bool,
}

/// The server's default limit of messages per atomic batch (`streamDefaultMaxAtomicBatchSize`).
pub const DEFAULT_BATCH_LIMIT: usize = 1000;

/// The most messages of one fast-ingest batch (F1): its commit's answer comes about once
/// per this many events.
pub const FAST_BATCH_LIMIT: usize = 1000;

/// The error codes of a server that refuses fast-ingest batches themselves (F4): batch
/// publish disabled on the stream, the reply subject's pattern or the batch id invalid.
pub const FAST_REFUSED: [u64; 3] = [10205, 10206, 10207];

/// One message's place in a fast-ingest batch's reply subject (F5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastReply<'a> {
    /// The session's token.
    pub token: &'a str,
    /// The session number of the batch's first message.
    pub first: u64,
    /// The initial flow: messages per flow-control answer the session asks for.
    pub flow: u64,
    /// The message's sequence in its batch, from 1.
    pub sequence: u64,
    /// Whether it is the batch's last (commit, op 2).
    pub commit: bool,
    /// F6: an end-of-batch commit (op 3), itself not stored; with `commit`.
    pub end_of_batch: bool,
}

impl FastReply<'_> {
    /// The reply subject's part after the session's reply prefix:
    /// `{token}-{first}.{flow}.fail.{sequence}.{op}.$FI`.
    pub fn write(&self, out: &mut bytes::BytesMut) {
        let mut number = itoa::Buffer::new();
        out.extend_from_slice(self.token.as_bytes());
        out.extend_from_slice(b"-");
        out.extend_from_slice(number.format(self.first).as_bytes());
        out.extend_from_slice(b".");
        out.extend_from_slice(number.format(self.flow).as_bytes());
        out.extend_from_slice(b".fail.");
        out.extend_from_slice(number.format(self.sequence).as_bytes());
        out.extend_from_slice(match (self.sequence, self.commit, self.end_of_batch) {
            (_, _, true) => b".3.$FI",
            (_, true, false) => b".2.$FI",
            (1, false, false) => b".0.$FI",
            _ => b".1.$FI",
        });
    }

    /// The longest such part for a session token of `token_len` bytes.
    pub fn max_len(token_len: usize) -> usize {
        let number = u64::MAX.to_string().len();
        token_len + 1 + number + 1 + 5 + ".fail.".len() + number + ".2.$FI".len()
    }
}

/// The session number of the publish a fast batch's answer is for, from its reply
/// subject's part after the session's reply prefix (F5); `None` if it is not one.
pub fn fast_answered(rest: &[u8]) -> Option<u64> {
    let rest = std::str::from_utf8(rest).ok()?.strip_suffix(".$FI")?;
    let mut parts = rest.split('.');
    let first = parts.next()?.rsplit_once('-')?.1.parse::<u64>().ok()?;
    let _flow = parts.next()?;
    let _gap = parts.next()?;
    let sequence = parts.next()?.parse::<u64>().ok()?;
    let _op = parts.next()?;
    if parts.next().is_some() || sequence == 0 {
        return None;
    }
    first.checked_add(sequence - 1)
}

/// The error code of a batch refused for a message id the stream already holds (B4).
pub const DUPLICATE_IN_BATCH: u64 = 10201;

/// Cuts one session's transactions into batches (B1, B5). Pure: the publisher hands it each
/// event it publishes and each transaction's end, and frames what it hands back. One event
/// is held back until the next item says whether it is its batch's last.
#[derive(Debug)]
pub(crate) struct Batches<E> {
    limit: u64,
    /// The session's token, the first part of every batch id.
    token: String,
    /// Batches begun in this session.
    number: u64,
    /// Messages of the open batch handed back already.
    framed: u64,
    /// The held-back event, the open batch's message `framed + 1`.
    held: Option<E>,
    /// The open batch's id.
    id: String,
}

impl<E> Batches<E> {
    /// Batches of at most `limit` (at least 1) messages, with ids under `token`.
    pub(crate) fn new(limit: usize, token: &str) -> Self {
        Batches {
            limit: limit.max(1) as u64,
            token: token.to_owned(),
            number: 0,
            framed: 0,
            held: None,
            id: String::new(),
        }
    }

    /// The held-back event when the limit makes it its batch's last: the batch's commit,
    /// not its transaction's end (B7: an event of the transaction follows). The publisher
    /// frames it before the next event takes a permit of the window, which a batch as large
    /// as the window would otherwise wait for until its own commit's answer.
    pub(crate) fn full(&mut self) -> Option<(E, Option<Batch>)> {
        if self.framed + 1 != self.limit {
            return None;
        }
        let held = self.held.take()?;
        self.framed = 0;
        Some((held, (self.limit > 1).then(|| self.batch(self.limit, true))))
    }

    /// The next event of the open transaction: the event to frame now, if any (the one held
    /// back until now: its batch's commit at the limit, [`Batches::full`], else not its
    /// batch's last), with its place in its batch, `None` for a batch of one (B6). This one
    /// is held back until the next item says whether it ends its transaction (B7).
    pub(crate) fn event(&mut self, event: E) -> Option<(E, Option<Batch>)> {
        let earlier = self.full().or_else(|| {
            self.held.take().map(|held| {
                self.framed += 1;
                (held, Some(self.batch(self.framed, false)))
            })
        });
        if self.framed == 0 {
            self.number += 1;
            self.id = format!("{}.{}", self.token, self.number);
        }
        self.held = Some(event);
        earlier
    }

    /// The open transaction ended (or something that is not one of its events came): the
    /// held-back event, as its batch's commit (`None`: the batch is that event alone, B6).
    pub(crate) fn close(&mut self) -> Option<(E, Option<Batch>)> {
        let held = self.held.take()?;
        let sequence = self.framed + 1;
        self.framed = 0;
        Some((held, (sequence > 1).then(|| self.batch(sequence, true))))
    }

    /// Whether an event is held back (a batch is open).
    pub(crate) fn is_open(&self) -> bool {
        self.held.is_some()
    }

    fn batch(&self, sequence: u64, commit: bool) -> Batch {
        Batch {
            id: self.id.clone(),
            sequence,
            commit,
        }
    }
}

/// The session's batch token (B5): the last part of its reply prefix (a NUID, 22
/// characters, under any inbox prefix), so that batch ids stay within the server's 64 bytes.
pub(crate) fn token(reply_prefix: &str) -> &str {
    let token = reply_prefix
        .trim_end_matches('.')
        .rsplit('.')
        .next()
        .unwrap_or_default();
    token.get(..40).unwrap_or(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds transactions of the given sizes and returns, per event, its batch's number,
    /// sequence and commit flag.
    fn cut(limit: usize, sizes: &[usize]) -> Vec<(u32, Option<Batch>)> {
        let mut batches = Batches::new(limit, "T");
        let mut out = Vec::new();
        let mut next = 0u32;
        for &size in sizes {
            for _ in 0..size {
                out.extend(batches.event(next));
                next += 1;
            }
            out.extend(batches.close());
            assert!(!batches.is_open());
        }
        out
    }

    #[test]
    fn every_event_once_in_order_and_each_transaction_one_batch_up_to_the_limit() {
        let sizes = [1, 10, 999, 1000, 1001, 5000, 1, 2];
        let out = cut(1000, &sizes);
        let events: Vec<u32> = out.iter().map(|(e, _)| *e).collect();
        let total: usize = sizes.iter().sum();
        assert_eq!(events, (0..total as u32).collect::<Vec<_>>());
        // Batches: sequence from 1 without a gap, exactly one commit, at its end.
        let mut by_id: Vec<(String, Vec<Batch>)> = Vec::new();
        for (_, batch) in &out {
            // B6: a batch of one is a plain message.
            let Some(batch) = batch else {
                by_id.push((String::new(), Vec::new()));
                continue;
            };
            match by_id.last_mut() {
                Some((id, list)) if *id == batch.id => list.push(batch.clone()),
                _ => by_id.push((batch.id.clone(), vec![batch.clone()])),
            }
        }
        let lens: Vec<usize> = by_id.iter().map(|(_, l)| l.len()).collect();
        assert_eq!(
            lens,
            [0, 10, 999, 1000, 1000, 0, 1000, 1000, 1000, 1000, 1000, 0, 2]
        );
        for (_, list) in &by_id {
            for (i, batch) in list.iter().enumerate() {
                assert_eq!(batch.sequence, i as u64 + 1);
                assert_eq!(batch.commit, i + 1 == list.len());
            }
        }
        let batches: Vec<_> = by_id.iter().filter(|(id, _)| !id.is_empty()).collect();
        let ids: std::collections::HashSet<_> = batches.iter().map(|(id, _)| id).collect();
        assert_eq!(ids.len(), batches.len(), "batch ids are unique");
    }

    #[test]
    fn a_limit_of_one_commits_every_event_and_a_session_ending_mid_transaction_commits_nothing() {
        let out = cut(1, &[3]);
        assert!(
            out.iter().all(|(_, b)| b.is_none()),
            "B6: batches of one are plain"
        );
        let mut batches = Batches::new(1000, "T");
        let framed: Vec<_> = (0..5).filter_map(|e| batches.event(e)).collect();
        assert!(framed
            .iter()
            .all(|(_, b)| b.as_ref().is_some_and(|b| !b.commit)));
        assert_eq!(framed.len(), 4);
        assert!(batches.is_open());
    }

    #[test]
    fn a_fast_reply_names_its_publish_and_fits_the_server_limits() {
        let token = token("_INBOX.abcdefghijklmnopqrstuv.");
        for (first, sequence, commit, end_of_batch, op) in [
            (1, 1, false, false, "0"),
            (7, 3, false, false, "1"),
            (7, 9, true, false, "2"),
            (7, 10, true, true, "3"),
        ] {
            let mut out = bytes::BytesMut::new();
            FastReply {
                token,
                first,
                flow: 1000,
                sequence,
                commit,
                end_of_batch,
            }
            .write(&mut out);
            let text = std::str::from_utf8(&out).unwrap();
            assert_eq!(
                text,
                format!("{token}-{first}.1000.fail.{sequence}.{op}.$FI"),
            );
            assert_eq!(fast_answered(&out), Some(first + sequence - 1));
            // The batch id (the token before the flow) is within the server's 64 bytes.
            assert!(text.split('.').next().unwrap().len() <= 64);
        }
        let mut longest = bytes::BytesMut::new();
        let long = "n".repeat(40);
        FastReply {
            token: &long,
            first: u64::MAX,
            flow: 65535,
            sequence: u64::MAX,
            commit: true,
            end_of_batch: false,
        }
        .write(&mut longest);
        assert_eq!(longest.len(), FastReply::max_len(40));
        for other in [
            &b"17"[..],
            b"x-1.5.fail.0.1.$FI",
            b"x-1.5.fail.2.1",
            b"x.5.fail.2.1.$FI",
            b"",
        ] {
            assert_eq!(fast_answered(other), None, "{other:?}");
        }
    }

    #[test]
    fn the_token_is_the_reply_prefix_last_part_and_ids_fit_the_server_limit() {
        assert_eq!(
            token("_INBOX.abcdefghijklmnopqrstuv."),
            "abcdefghijklmnopqrstuv"
        );
        assert_eq!(token("custom.inbox.x1."), "x1");
        let long = format!("p.{}.", "n".repeat(80));
        assert_eq!(token(&long).len(), 40);
        assert!(format!("{}.{}", token(&long), u64::MAX).len() <= 64);
    }
}
