//! The replication stream (CopyBoth mode) and the standby status feedback policy.
//!
//! # Receiving
//! [`ReplicationStream::recv`] returns the next `XLogData` or `PrimaryKeepalive`. It is
//! cancel-safe: bytes are read into a buffer owned by the stream (at least 64 KiB of free
//! space per read, normally 256 KiB, because the walsender gets cheaper when its reader takes
//! data in large batches), so a `recv` dropped in a `select!` loses nothing and the next one
//! continues where it stopped. Messages are `Bytes` slices of that buffer (no copy). A server
//! NoticeResponse is logged and skipped; an ErrorResponse, a CopyDone, or the end of the
//! connection is an error, since the server never ends a healthy logical stream on its own.
//! [`ReplicationStream::try_recv_buffered`] returns a message only if it is already complete
//! in the buffer, for callers that batch.
//!
//! # Sending
//! The socket is split: `recv` owns the read half, [`ReplicationStream::send_status`] the
//! write half, so a status update can go out while a `recv` is pending in the same task's
//! `select!`. A `send_status` cancelled midway never tears a message: what was not written
//! stays buffered and goes out first on the next send.
//!
//! # Feedback
//! The walsender needs to hear from us at least every `wal_sender_timeout` or it drops the
//! connection, and it advances the slot (`confirmed_flush_lsn`, which lets it recycle WAL)
//! only to what we report as flushed. [`Feedback`] decides when to report and what:
//! - **What:** `write = flush = apply =` the LSN the caller confirmed with
//!   [`Feedback::update`], i.e. everything at or below it is durably delivered. Never more
//!   (invariant R1). Reporting a larger *write* position would also be wrong for another
//!   reason: the walsender sends a keepalive whenever it waits for WAL while our reported
//!   write and flush positions are behind what it has sent, and those keepalives are how the
//!   caller learns that WAL it skipped (other tables, other databases) may be confirmed.
//!   Before the first `update` the reported position is `0/0`, which the server ignores.
//! - **When:** at least every [`status_interval`] (`min(10 s, wal_sender_timeout / 2)`),
//!   whatever the data flow (R2), and sooner, at most once per [`PROGRESS_INTERVAL`] (1 s),
//!   when the confirmed LSN moved since the last report, so the slot follows acks closely
//!   without a message per ack. And at once when a `PrimaryKeepalive` asks for a reply.
//! - **Liveness:** a heartbeat (no progress since the last report) sets `reply_requested`,
//!   so the server answers with a keepalive. Without it, a client that reports on time is
//!   never pinged, and a server that vanished without closing the connection would leave
//!   `recv` waiting forever; [`ReplicationStream::set_idle_timeout`] turns that silence
//!   into a transient error.
//!
//! The caller's reader task (the relay's pipeline) runs, for example:
//!
//! ```ignore
//! let mut feedback = Feedback::new(status_interval(connection.wal_sender_timeout().await?));
//! feedback.update(resume_lsn);
//! let mut stream = connection.start_logical_replication(slot, resume_lsn, &options).await?;
//! loop {
//!     let deadline = feedback.next_due().unwrap_or_else(Instant::now);
//!     tokio::select! {
//!         biased;
//!         // PRIORITY 1: shutdown. Cancel-safe (a watch/token).
//!         _ = shutdown.changed() => break,
//!         // PRIORITY 2: confirmed LSN moved. Cancel-safe (watch::Receiver::changed).
//!         _ = confirmed.changed() => feedback.update(*confirmed.borrow_and_update()),
//!         // PRIORITY 3: status due. Cancel-safe (sleep_until holds no state).
//!         _ = tokio::time::sleep_until(deadline) => stream.send_feedback(&mut feedback).await?,
//!         // PRIORITY 4: new WAL. Cancel-safe (ReplicationStream::recv).
//!         message = stream.recv() => match message? {
//!             ReplicationMessage::PrimaryKeepalive(k) if k.reply_requested => {
//!                 stream.send_feedback(&mut feedback).await?
//!             }
//!             message => forward(message).await?,
//!         },
//!     }
//! }
//! stream.send_feedback(&mut feedback).await?; // the acked watermark only
//! stream.finish().await?;
//! ```

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use pgoutput::copy_data::{PgTimestamp, PG_EPOCH_UNIX_SECONDS};
use pgoutput::{Lsn, ReplicationMessage, StandbyStatusUpdate};
use postgres_protocol::message::frontend;
use tokio::io::{ReadHalf, WriteHalf};
use tokio::time::Instant;

use crate::wire::{self, BoxSocket, FrameReader, FrameWriter};
use crate::Error;

/// How long [`ReplicationStream::finish`] waits for the server to end the stream.
pub const FINISH_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest interval between status updates (pg_recvlogical's default).
pub const MAX_STATUS_INTERVAL: Duration = Duration::from_secs(10);

/// The shortest interval between status updates that only report progress.
pub const PROGRESS_INTERVAL: Duration = Duration::from_secs(1);

/// A floor for tiny `wal_sender_timeout`s, so that feedback never spins.
const MIN_STATUS_INTERVAL: Duration = Duration::from_millis(50);

/// A logical replication stream; see the module docs.
pub struct ReplicationStream {
    reader: FrameReader<ReadHalf<BoxSocket>>,
    writer: FrameWriter<WriteHalf<BoxSocket>>,
    user: String,
    target: String,
    idle_timeout: Option<Duration>,
    last_received: Instant,
}

impl fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicationStream")
            .field("target", &self.target)
            .field("buffered", &self.reader.buffered())
            .finish_non_exhaustive()
    }
}

impl ReplicationStream {
    pub(crate) fn new(
        reader: FrameReader<ReadHalf<BoxSocket>>,
        writer: FrameWriter<WriteHalf<BoxSocket>>,
        user: String,
        target: String,
    ) -> Self {
        ReplicationStream {
            reader,
            writer,
            user,
            target,
            idle_timeout: None,
            last_received: Instant::now(),
        }
    }

    /// Makes [`ReplicationStream::recv`] fail with a (transient) [`Error::Timeout`] when no
    /// byte has arrived for `limit`, to detect a server that vanished without closing the
    /// connection. Off by default. Heartbeat updates from [`Feedback`] ask the server for a
    /// reply, so a healthy server is heard from at least every status interval; a limit of
    /// `wal_sender_timeout` (the bound the server holds us to) is a good choice.
    pub fn set_idle_timeout(&mut self, limit: Option<Duration>) {
        self.idle_timeout = limit;
    }

    /// When the last byte arrived from the server.
    pub fn last_received(&self) -> Instant {
        self.last_received
    }

    /// A stream over any socket already in CopyBoth mode (tests).
    #[cfg(test)]
    pub(crate) fn from_socket(socket: BoxSocket) -> Self {
        let (read, write) = tokio::io::split(socket);
        let target = "test".to_owned();
        ReplicationStream::new(
            FrameReader::new(read, target.clone()),
            FrameWriter::new(write, target.clone()),
            "test".to_owned(),
            target,
        )
    }

    /// The next message from the server. Cancel-safe.
    pub async fn recv(&mut self) -> Result<ReplicationMessage, Error> {
        loop {
            if let Some(message) = self.next_buffered()? {
                return Ok(message);
            }
            let fill = self.reader.fill("while streaming");
            match self.idle_timeout {
                None => fill.await?,
                // Cancel-safe too: a timed-out `fill` has added nothing to the buffer.
                Some(limit) => {
                    match tokio::time::timeout_at(self.last_received + limit, fill).await {
                        Ok(result) => result?,
                        Err(_) => {
                            return Err(Error::Timeout {
                                what: format!(
                                    "waiting for data or a keepalive from {}",
                                    self.target
                                ),
                                after: limit,
                            })
                        }
                    }
                }
            }
            self.last_received = Instant::now();
        }
    }

    /// The next message if it is complete in the buffer; no I/O.
    pub fn try_recv_buffered(&mut self) -> Option<Result<ReplicationMessage, Error>> {
        self.next_buffered().transpose()
    }

    /// Bytes received but not yet returned by `recv`.
    pub fn buffered_bytes(&self) -> usize {
        self.reader.buffered()
    }

    fn next_buffered(&mut self) -> Result<Option<ReplicationMessage>, Error> {
        while let Some(frame) = self.reader.try_frame()? {
            match frame.tag {
                wire::COPY_DATA => return Ok(Some(ReplicationMessage::decode(frame.body)?)),
                wire::NOTICE_RESPONSE => wire::log_notice(&frame.body, &self.target),
                wire::ERROR_RESPONSE => return Err(wire::error_response(&frame.body, &self.user)),
                wire::COPY_DONE => return Err(Error::StreamEnded),
                other => {
                    return Err(Error::protocol(format!(
                        "unexpected message '{}' in the replication stream",
                        char::from(other).escape_default()
                    )))
                }
            }
        }
        Ok(None)
    }

    /// Sends a standby status update and flushes it. Uses only the write half, so it can run
    /// while a `recv` is pending. Not cancel-safe in the sense that the update may or may not
    /// have gone out, but a cancelled send never corrupts the stream.
    pub async fn send_status(&mut self, update: StandbyStatusUpdate) -> Result<(), Error> {
        wire::encode_status_update(&update, &mut self.writer.buf);
        self.writer.flush().await
    }

    /// Sends `feedback`'s status update and marks it sent, as of the moment it was built:
    /// the next one is then due one interval after this one's `send_time`, however long the
    /// write took (timing it from the write's end would let the spacing between two updates
    /// exceed the interval, and a caller that wakes exactly at the due time could find the
    /// update "not yet due" and skip a whole period).
    pub async fn send_feedback(&mut self, feedback: &mut Feedback) -> Result<(), Error> {
        let built = Instant::now();
        let update = feedback.status(SystemTime::now());
        self.send_status(update).await?;
        feedback.sent(built);
        tracing::trace!(flush_lsn = %update.flush_lsn, "standby status update sent");
        Ok(())
    }

    /// Ends the stream: sends CopyDone, reads until the server is ready for a new command
    /// (discarding data still in flight), then sends Terminate and closes, all within
    /// [`FINISH_TIMEOUT`]. It sends no status update: send the acked watermark first.
    pub async fn finish(mut self) -> Result<(), Error> {
        let target = self.target.clone();
        tokio::time::timeout(FINISH_TIMEOUT, async move {
            frontend::copy_done(&mut self.writer.buf);
            self.writer.flush().await?;
            loop {
                let frame = self.reader.next_frame("while ending the stream").await?;
                match frame.tag {
                    wire::COPY_DATA | wire::COPY_DONE | wire::COMMAND_COMPLETE => {}
                    wire::NOTICE_RESPONSE => wire::log_notice(&frame.body, &self.target),
                    wire::ERROR_RESPONSE => {
                        return Err(wire::error_response(&frame.body, &self.user))
                    }
                    wire::READY_FOR_QUERY => break,
                    other => {
                        return Err(Error::protocol(format!(
                            "unexpected message '{}' while ending the stream",
                            char::from(other).escape_default()
                        )))
                    }
                }
            }
            frontend::terminate(&mut self.writer.buf);
            self.writer.flush().await?;
            self.writer.shutdown().await
        })
        .await
        .map_err(|_| Error::Timeout {
            what: format!("ending the replication stream with {target}"),
            after: FINISH_TIMEOUT,
        })?
    }
}

/// How often to send status updates when nothing else prompts one:
/// `min(10 s, wal_sender_timeout / 2)`, or 10 s when the timeout is disabled (`None` or 0).
pub fn status_interval(wal_sender_timeout: Option<Duration>) -> Duration {
    match wal_sender_timeout {
        Some(timeout) if !timeout.is_zero() => {
            (timeout / 2).clamp(MIN_STATUS_INTERVAL, MAX_STATUS_INTERVAL)
        }
        _ => MAX_STATUS_INTERVAL,
    }
}

/// Parses `SHOW wal_sender_timeout` output (`60s`, `1min`, `500ms`, `0`); `None` when the
/// timeout is disabled. A bare number is in milliseconds, the setting's base unit.
pub fn parse_wal_sender_timeout(text: &str) -> Result<Option<Duration>, Error> {
    let text = text.trim();
    let bad = || Error::protocol(format!("cannot parse wal_sender_timeout {text:?}"));
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number.parse().map_err(|_| bad())?;
    let duration = match unit.trim() {
        "" | "ms" => Duration::from_millis(number),
        "us" => Duration::from_micros(number),
        "s" => Duration::from_secs(number),
        "min" => Duration::from_secs(number.checked_mul(60).ok_or_else(bad)?),
        "h" => Duration::from_secs(number.checked_mul(3600).ok_or_else(bad)?),
        "d" => Duration::from_secs(number.checked_mul(86_400).ok_or_else(bad)?),
        _ => return Err(bad()),
    };
    Ok((!duration.is_zero()).then_some(duration))
}

/// Microseconds since 2000-01-01 00:00:00 UTC, the server's timestamp format.
pub fn pg_timestamp(time: SystemTime) -> PgTimestamp {
    let pg_epoch = UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECONDS.unsigned_abs());
    match time.duration_since(pg_epoch) {
        Ok(since) => i64::try_from(since.as_micros()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_micros())
            .map(|micros| -micros)
            .unwrap_or(i64::MIN),
    }
}

/// When to send standby status updates and what they say; see the module docs. Sync and
/// pure: the caller passes the time.
#[derive(Debug, Clone)]
pub struct Feedback {
    interval: Duration,
    flush_lsn: Lsn,
    reported_lsn: Option<Lsn>,
    last_sent: Option<Instant>,
}

impl Feedback {
    /// Feedback at least every `interval` (use [`status_interval`]).
    pub fn new(interval: Duration) -> Self {
        Feedback {
            interval: interval.max(MIN_STATUS_INTERVAL),
            flush_lsn: Lsn::ZERO,
            reported_lsn: None,
            last_sent: None,
        }
    }

    /// The longest time between two updates.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Records that everything at or below `flush_lsn` is durably delivered. Monotonic: a
    /// lower LSN is ignored. Returns whether the confirmed LSN advanced.
    pub fn update(&mut self, flush_lsn: Lsn) -> bool {
        if flush_lsn > self.flush_lsn {
            self.flush_lsn = flush_lsn;
            true
        } else {
            false
        }
    }

    /// The confirmed LSN the next update will report.
    pub fn flush_lsn(&self) -> Lsn {
        self.flush_lsn
    }

    /// The LSN of the last update sent, if any.
    pub fn reported_lsn(&self) -> Option<Lsn> {
        self.reported_lsn
    }

    /// When the next update is due; `None` means now (nothing sent yet).
    pub fn next_due(&self) -> Option<Instant> {
        let last = self.last_sent?;
        let progress_pending = self.reported_lsn != Some(self.flush_lsn);
        let wait = if progress_pending {
            PROGRESS_INTERVAL.min(self.interval)
        } else {
            self.interval
        };
        Some(last + wait)
    }

    /// Whether an update is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.next_due().is_none_or(|due| now >= due)
    }

    /// The update to send: write = flush = apply = the confirmed LSN. A heartbeat (an
    /// update with no progress since the last one) asks the server to reply, so that an
    /// idle but healthy server is heard from every interval (see
    /// [`ReplicationStream::set_idle_timeout`]); the server answers with a keepalive that
    /// does not itself ask for a reply.
    pub fn status(&self, now: SystemTime) -> StandbyStatusUpdate {
        StandbyStatusUpdate {
            write_lsn: self.flush_lsn,
            flush_lsn: self.flush_lsn,
            apply_lsn: self.flush_lsn,
            send_time: pg_timestamp(now),
            reply_requested: self.reported_lsn == Some(self.flush_lsn),
        }
    }

    /// Records that the update from [`Feedback::status`] went out at `now`.
    pub fn sent(&mut self, now: Instant) {
        self.last_sent = Some(now);
        self.reported_lsn = Some(self.flush_lsn);
    }
}

/// Whether `message` is a keepalive that asks for an immediate status update.
pub fn reply_requested(message: &ReplicationMessage) -> bool {
    matches!(message, ReplicationMessage::PrimaryKeepalive(k) if k.reply_requested)
}

/// The payload of an `XLogData`, if `message` is one.
pub fn xlog_payload(message: &ReplicationMessage) -> Option<&Bytes> {
    match message {
        ReplicationMessage::XLogData(x) => Some(&x.data),
        ReplicationMessage::PrimaryKeepalive(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use pgoutput::PrimaryKeepalive;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn copy_data(body: &[u8]) -> Vec<u8> {
        let mut out = vec![b'd'];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    fn xlog(start: u64, data: &[u8]) -> Vec<u8> {
        let mut body = vec![b'w'];
        body.extend_from_slice(&start.to_be_bytes());
        body.extend_from_slice(&(start + 100).to_be_bytes());
        body.extend_from_slice(&7i64.to_be_bytes());
        body.extend_from_slice(data);
        copy_data(&body)
    }

    fn keepalive(end: u64, reply: bool) -> Vec<u8> {
        let mut body = vec![b'k'];
        body.extend_from_slice(&end.to_be_bytes());
        body.extend_from_slice(&9i64.to_be_bytes());
        body.push(u8::from(reply));
        copy_data(&body)
    }

    fn server_error(code: &str) -> Vec<u8> {
        let body = format!("SFATAL\0VFATAL\0C{code}\0Mterminating connection\0\0");
        let mut out = vec![b'E'];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body.as_bytes());
        out
    }

    #[test]
    fn wal_sender_timeout_units() {
        let parse = |t| parse_wal_sender_timeout(t).unwrap();
        assert_eq!(parse("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse("2h"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("1d"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse("1500"), Some(Duration::from_millis(1500)));
        assert_eq!(parse("250us"), Some(Duration::from_micros(250)));
        assert_eq!(parse("0"), None);
        assert_eq!(parse("0ms"), None);
        for bad in [
            "",
            "s",
            "-1",
            "1 fortnight",
            "1.5s",
            "99999999999999999999d",
        ] {
            assert!(parse_wal_sender_timeout(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn status_interval_is_half_the_timeout_capped_at_ten_seconds() {
        let secs = Duration::from_secs;
        for (timeout, interval) in [
            (None, secs(10)),
            (Some(Duration::ZERO), secs(10)),
            (Some(secs(60)), secs(10)),
            (Some(secs(20)), secs(10)),
            (Some(secs(2)), secs(1)),
            (Some(Duration::from_millis(2)), Duration::from_millis(50)),
        ] {
            assert_eq!(status_interval(timeout), interval, "{timeout:?}");
        }
    }

    #[test]
    fn pg_timestamps() {
        let pg_epoch = UNIX_EPOCH + Duration::from_secs(946_684_800);
        assert_eq!(pg_timestamp(pg_epoch), 0);
        assert_eq!(
            pg_timestamp(pg_epoch + Duration::from_micros(1_500_001)),
            1_500_001
        );
        assert_eq!(pg_timestamp(pg_epoch - Duration::from_secs(1)), -1_000_000);
    }

    #[test]
    fn feedback_reports_only_what_it_was_given() {
        let mut feedback = Feedback::new(Duration::from_secs(10));
        let now = SystemTime::now();
        let status = feedback.status(now);
        assert_eq!(status.flush_lsn, Lsn::ZERO, "nothing confirmed yet");
        assert!(feedback.update(Lsn(100)));
        assert!(!feedback.update(Lsn(50)), "regressions are ignored");
        assert!(!feedback.update(Lsn(100)));
        let status = feedback.status(now);
        assert_eq!(
            (status.write_lsn, status.flush_lsn, status.apply_lsn),
            (Lsn(100), Lsn(100), Lsn(100))
        );
        assert!(!status.reply_requested, "news is not a heartbeat");
        assert_eq!(status.send_time, pg_timestamp(now));
        feedback.sent(Instant::now());
        assert!(
            feedback.status(now).reply_requested,
            "a heartbeat asks the server to answer"
        );
    }

    #[test]
    fn feedback_timing() {
        let start = Instant::now();
        let mut feedback = Feedback::new(Duration::from_secs(10));
        assert!(feedback.due(start), "due before the first update is sent");
        assert_eq!(feedback.next_due(), None);
        feedback.sent(start);
        assert_eq!(feedback.reported_lsn(), Some(Lsn::ZERO));
        assert!(!feedback.due(start + Duration::from_secs(9)));
        assert!(feedback.due(start + Duration::from_secs(10)), "heartbeat");
        assert_eq!(feedback.next_due(), Some(start + Duration::from_secs(10)));

        // Progress goes out sooner, but at most once per PROGRESS_INTERVAL.
        feedback.update(Lsn(5));
        assert_eq!(feedback.next_due(), Some(start + PROGRESS_INTERVAL));
        assert!(!feedback.due(start + Duration::from_millis(999)));
        assert!(feedback.due(start + PROGRESS_INTERVAL));
        let later = start + PROGRESS_INTERVAL;
        feedback.sent(later);
        assert_eq!(feedback.reported_lsn(), Some(Lsn(5)));
        assert!(
            !feedback.due(later + Duration::from_secs(5)),
            "no news, no hurry"
        );
        assert!(feedback.due(later + Duration::from_secs(10)));

        // A short interval is not stretched by the progress rule.
        let mut fast = Feedback::new(Duration::from_millis(200));
        fast.sent(start);
        fast.update(Lsn(1));
        assert_eq!(fast.next_due(), Some(start + Duration::from_millis(200)));
    }

    #[test]
    fn keepalive_helpers() {
        let ask = ReplicationMessage::PrimaryKeepalive(PrimaryKeepalive {
            wal_end_lsn: Lsn(1),
            send_time: 0,
            reply_requested: true,
        });
        assert!(reply_requested(&ask));
        assert_eq!(xlog_payload(&ask), None);
    }

    #[tokio::test]
    async fn recv_decodes_skips_notices_and_reports_errors() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        let notice = {
            let body = b"SNOTICE\0VNOTICE\0C00000\0Mhello\0\0";
            let mut out = vec![b'N'];
            out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            out.extend_from_slice(body);
            out
        };
        let raw = [
            xlog(1, b"Bbegin"),
            notice,
            keepalive(200, true),
            server_error("57P01"),
        ]
        .concat();
        server.write_all(&raw).await.unwrap();

        let ReplicationMessage::XLogData(x) = stream.recv().await.unwrap() else {
            panic!("expected XLogData")
        };
        assert_eq!((x.wal_start_lsn, &x.data[..]), (Lsn(1), &b"Bbegin"[..]));
        let keepalive = stream.recv().await.unwrap();
        assert!(reply_requested(&keepalive));
        let error = stream.recv().await.unwrap_err();
        assert_eq!(error.sqlstate(), Some("57P01"));
        assert!(error.is_transient());
    }

    #[tokio::test]
    async fn end_of_stream_and_copy_done_are_transient_errors() {
        let (client, mut server) = tokio::io::duplex(1024);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        server.write_all(&[b'c', 0, 0, 0, 4]).await.unwrap();
        let error = stream.recv().await.unwrap_err();
        assert!(matches!(error, Error::StreamEnded), "{error}");
        assert!(error.is_transient());

        let (client, server) = tokio::io::duplex(1024);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        drop(server);
        let error = stream.recv().await.unwrap_err();
        assert!(matches!(error, Error::Closed { .. }), "{error}");
        assert!(error.is_transient());

        let (client, mut server) = tokio::io::duplex(1024);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        server.write_all(&[b'Z', 0, 0, 0, 5, b'I']).await.unwrap();
        assert!(matches!(stream.recv().await, Err(Error::Protocol(_))));
    }

    #[tokio::test]
    async fn recv_is_cancel_safe_mid_frame() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        let payload = vec![b'x'; 10_000];
        let frame = xlog(42, &payload);
        let (head, tail) = frame.split_at(frame.len() / 2);
        server.write_all(head).await.unwrap();

        // Poll recv until it has consumed the first half and is waiting, then drop it.
        {
            let mut recv = pin!(stream.recv());
            let mut cx = Context::from_waker(std::task::Waker::noop());
            for _ in 0..10 {
                assert!(matches!(recv.as_mut().poll(&mut cx), Poll::Pending));
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(
            stream.buffered_bytes(),
            head.len(),
            "the half frame was read"
        );
        assert!(stream.try_recv_buffered().is_none());

        server.write_all(tail).await.unwrap();
        let ReplicationMessage::XLogData(x) = stream.recv().await.unwrap() else {
            panic!("expected XLogData")
        };
        assert_eq!(x.wal_start_lsn, Lsn(42));
        assert_eq!(x.data.len(), payload.len());
        assert!(x.data.iter().all(|b| *b == b'x'));
    }

    #[tokio::test]
    async fn recv_in_select_loses_nothing_when_another_branch_wins() {
        let (client, mut server) = tokio::io::duplex(64);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        let frames: Vec<Vec<u8>> = (0..50u64).map(|i| xlog(i, &[b'a'; 300])).collect();
        let raw = frames.concat();
        // Dribble the bytes in tiny writes through a 64-byte pipe.
        let writer = tokio::spawn(async move {
            for chunk in raw.chunks(7) {
                server.write_all(chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
            server
        });
        let mut got = Vec::new();
        let mut ticks = tokio::time::interval(Duration::from_micros(10));
        while got.len() < 50 {
            tokio::select! {
                biased;
                _ = ticks.tick() => {}
                message = stream.recv() => {
                    let ReplicationMessage::XLogData(x) = message.unwrap() else { panic!() };
                    got.push(x.wal_start_lsn.0);
                }
            }
        }
        assert_eq!(got, (0..50).collect::<Vec<_>>());
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn idle_timeout_detects_a_silent_server() {
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        stream.set_idle_timeout(Some(Duration::from_millis(200)));
        // Data keeps it alive...
        for i in 0..3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            server.write_all(&keepalive(i, false)).await.unwrap();
            assert!(stream.recv().await.is_ok());
        }
        // ... silence ends it, and the error is transient.
        let before = Instant::now();
        let error = stream.recv().await.unwrap_err();
        assert!(matches!(error, Error::Timeout { .. }), "{error}");
        assert!(error.is_transient());
        assert!(before.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn try_recv_buffered_batches_without_io() {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        let raw = [xlog(1, b"B"), xlog(2, b"I"), xlog(3, b"C")].concat();
        server.write_all(&raw).await.unwrap();
        let first = stream.recv().await.unwrap();
        assert!(matches!(first, ReplicationMessage::XLogData(_)));
        let mut rest = Vec::new();
        while let Some(message) = stream.try_recv_buffered() {
            rest.push(message.unwrap());
        }
        assert_eq!(rest.len(), 2);
        assert_eq!(stream.buffered_bytes(), 0);
        assert!(stream.try_recv_buffered().is_none());
    }

    #[tokio::test]
    async fn reads_use_a_large_buffer() {
        let (client, _server) = tokio::io::duplex(1024);
        let (read, _write) = tokio::io::split(client);
        let reader = FrameReader::new(read, "t".into());
        assert!(reader.capacity() >= wire::READ_CAPACITY);
    }

    #[tokio::test]
    async fn send_status_while_recv_is_pending() {
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let mut stream = ReplicationStream::from_socket(Box::new(client));
        let mut feedback = Feedback::new(Duration::from_secs(10));
        feedback.update(Lsn(0x1234));
        stream.send_feedback(&mut feedback).await.unwrap();
        let mut envelope = [0u8; 5 + StandbyStatusUpdate::ENCODED_LEN];
        server.read_exact(&mut envelope).await.unwrap();
        assert_eq!(&envelope[..6], &[b'd', 0, 0, 0, 38, b'r']);
        let mut expected = BytesMut::new();
        expected.put_u64(0x1234);
        assert_eq!(&envelope[6..14], &expected[..], "write_lsn");
        assert_eq!(&envelope[14..22], &expected[..], "flush_lsn");
        assert_eq!(&envelope[22..30], &expected[..], "apply_lsn");
        assert_eq!(feedback.reported_lsn(), Some(Lsn(0x1234)));

        // Status updates go out while a recv is pending in the same select loop.
        let mut ticker = tokio::time::interval(Duration::from_millis(1));
        let mut statuses = 0;
        while statuses < 3 {
            tokio::select! {
                biased;
                _ = ticker.tick() => {
                    stream.send_status(feedback.status(SystemTime::now())).await.unwrap();
                    statuses += 1;
                }
                message = stream.recv() => panic!("unexpected {message:?}"),
            }
        }
        let mut three = [0u8; 3 * (5 + StandbyStatusUpdate::ENCODED_LEN)];
        server.read_exact(&mut three).await.unwrap();
    }

    #[tokio::test]
    async fn finish_sends_copy_done_and_drains() {
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let stream = ReplicationStream::from_socket(Box::new(client));
        let server_side = tokio::spawn(async move {
            let mut copy_done = [0u8; 5];
            server.read_exact(&mut copy_done).await.unwrap();
            assert_eq!(copy_done, [b'c', 0, 0, 0, 4]);
            let mut reply = xlog(1, b"late data");
            reply.extend_from_slice(&[b'c', 0, 0, 0, 4]);
            let tag = b"COPY 0\0";
            reply.push(b'C');
            reply.extend_from_slice(&(tag.len() as u32 + 4).to_be_bytes());
            reply.extend_from_slice(tag);
            reply.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'I']);
            server.write_all(&reply).await.unwrap();
            let mut terminate = [0u8; 5];
            server.read_exact(&mut terminate).await.unwrap();
            assert_eq!(terminate, [b'X', 0, 0, 0, 4]);
        });
        stream.finish().await.unwrap();
        server_side.await.unwrap();
    }
}
