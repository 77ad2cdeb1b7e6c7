//! The reader task: the server's operations read from the socket, each answer matched to
//! its publish (CN3, CN4), PINGs answered.

use super::*;

/// What the reader task holds.
pub(super) struct Reader {
    pub(super) read: tokio::io::ReadHalf<Stream>,
    /// Starts with what the handshake read past its last `PONG` (CN8).
    pub(super) buffer: BytesMut,
    pub(super) answers: mpsc::Sender<Answer>,
    pub(super) reply_prefix: String,
    pub(super) info: Info,
    pub(super) unanswered: Arc<AtomicU32>,
    pub(super) pongs: Arc<Pongs>,
    pub(super) lame_duck: Arc<AtomicBool>,
    pub(super) learned: Arc<Mutex<Learned>>,
    pub(super) server: String,
}

/// The reader task: has `PING`s answered, hands every answer on the session's subscription
/// to the acker, read and owned, applies in-session `INFO`s (CN6), and ends with
/// [`Answer::Closed`] (CN3, CN4, CN7).
pub(super) async fn read_answers(mut reader: Reader) {
    let max_payload = if reader.info.max_payload == 0 {
        MAX_INFO_LINE
    } else {
        reader.info.max_payload
    };
    let why = loop {
        match reader.answer_buffered(max_payload).await {
            Buffered::Read => {}
            Buffered::Closed(why) => break why,
            Buffered::AckerGone => return,
        }
        match reader.read.read_buf(&mut reader.buffer).await {
            Ok(0) => break "the NATS server closed the connection".to_owned(),
            Ok(_) => {}
            Err(error) => break format!("cannot read from NATS: {error}"),
        }
    };
    let _ = reader.answers.send(Answer::Closed(why)).await;
}

/// Where the reader stands after the operations its buffer holds.
pub(super) enum Buffered {
    /// Every whole operation is taken: read more.
    Read,
    /// The connection is to be closed, for this reason (CN3, CN4, CN7).
    Closed(String),
    /// The acker is gone: the session ended.
    AckerGone,
}

impl Reader {
    /// Takes every whole operation in the buffer, handing the answers to the acker.
    pub(super) async fn answer_buffered(&mut self, max_payload: usize) -> Buffered {
        loop {
            let (reading, used) = match wire::parse(&self.buffer, MAX_INFO_LINE, max_payload) {
                Parsed::Op(op, used) => (answer_of(op, &self.reply_prefix), used),
                Parsed::Incomplete => return Buffered::Read,
                Parsed::Invalid(why) => {
                    return Buffered::Closed(format!(
                        "the NATS server sent what is not the protocol: {why}"
                    ))
                }
            };
            self.buffer.advance(used);
            let answer = match self.on_reading(reading) {
                Ok(Some(answer)) => answer,
                Ok(None) => continue,
                Err(why) => return Buffered::Closed(why),
            };
            if self.answers.send(answer).await.is_err() {
                return Buffered::AckerGone;
            }
        }
    }

    /// What one operation read means: `Ok(Some)` an answer for the acker, `Ok(None)` nothing
    /// for it (a `PING` to answer, a `PONG`, an `INFO` with nothing to tell), `Err` the
    /// session's end (an `-ERR` other than a denied publish, CN7).
    #[inline]
    pub(super) fn on_reading(&mut self, reading: Reading) -> Result<Option<Answer>, String> {
        match reading {
            Reading::Answer(answer) => Ok(Some(answer)),
            Reading::Ping => {
                self.pongs.owed.fetch_add(1, Ordering::Relaxed);
                self.pongs.notify.notify_one();
                Ok(None)
            }
            Reading::Pong => {
                self.unanswered.store(0, Ordering::Relaxed);
                Ok(None)
            }
            Reading::Info(json) => self.apply(&json),
            Reading::Error(text) => match classify(&text) {
                ServerError::PublishDenied(subject) => Ok(Some(Answer::Denied {
                    subject: subject.to_owned(),
                    why: text.clone(),
                })),
                _ => Err(format!("the NATS server said: {text}")),
            },
            Reading::Nothing => Ok(None),
        }
    }

    /// Applies an in-session `INFO` (CN6): `Ok(Some)` for the acker, `Err` ends the session.
    pub(super) fn apply(&mut self, json: &[u8]) -> Result<Option<Answer>, String> {
        let before = self.info.max_payload;
        let was_lame = self.info.ldm;
        self.info.update(json)?;
        if let Some(urls) = &self.info.connect_urls {
            self.learned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .connect_urls
                .clone_from(urls);
        }
        if self.info.max_payload < before {
            return Err(format!(
                "the NATS server lowered max_payload from {before} to {} bytes; the next session checks events against it",
                self.info.max_payload
            ));
        }
        if self.info.ldm && !was_lame {
            info!(server = %self.server, "the NATS server is going into lame-duck mode: finishing what is in flight, the next session dials another server");
            self.learned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .lame_duck = Some(self.server.clone());
            self.lame_duck.store(true, Ordering::Relaxed);
            return Ok(Some(Answer::LameDuck));
        }
        Ok(None)
    }
}

pub(super) enum Reading {
    Answer(Answer),
    Ping,
    /// The answer to one of our `PING`s (CN4).
    Pong,
    Info(Vec<u8>),
    Error(String),
    Nothing,
}

pub(super) fn answer_of(op: ServerOp<'_>, reply_prefix: &str) -> Reading {
    match op {
        ServerOp::Msg {
            subject,
            sid,
            headers,
            payload,
            ..
        } if sid == SID => {
            let Some(rest) = subject.strip_prefix(reply_prefix.as_bytes()) else {
                return Reading::Nothing;
            };
            let numbered = std::str::from_utf8(rest).ok().and_then(|n| n.parse().ok());
            let Some(sequence) = numbered else {
                return crate::batch::fast_answered(rest)
                    .map_or(Reading::Nothing, |sequence| fast_answer(sequence, payload));
            };
            let status = headers.and_then(wire::status);
            Reading::Answer(Answer::Ack {
                sequence,
                ack: ack::read_parts(status, payload).map(Acked::from),
            })
        }
        ServerOp::Ping => Reading::Ping,
        ServerOp::Pong => Reading::Pong,
        ServerOp::Info(json) => Reading::Info(json.to_vec()),
        ServerOp::Err(text) => Reading::Error(String::from_utf8_lossy(text).into_owned()),
        _ => Reading::Nothing,
    }
}

/// An answer to publish `sequence`, a message of a fast-ingest batch (`crate::batch` F3):
/// a flow-control ack is dropped (it confirms nothing the relay relies on); a gap report is
/// an error; anything else (a PubAck, the `err` report of a refused message) is read as
/// any answer is.
pub(super) fn fast_answer(sequence: u64, payload: &[u8]) -> Reading {
    if payload.starts_with(br#"{"type":"ack""#) {
        return Reading::Nothing;
    }
    let ack = if payload.starts_with(br#"{"type":"gap""#) {
        Err(PublishError::with_source(
            async_nats::jetstream::context::PublishErrorKind::Other,
            format!(
                "a message of the fast batch went missing: {}",
                String::from_utf8_lossy(payload)
            ),
        ))
    } else {
        ack::read_parts(None, payload).map(Acked::from)
    };
    Reading::Answer(Answer::Ack { sequence, ack })
}
