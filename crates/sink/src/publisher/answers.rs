//! The answers awaited on the publish side ([`Acks`]): each publish's answer matched to
//! it in order, a fast batch's answers checked, the connection's end told to every publish
//! still awaited (CN3).

use super::*;

/// The acker's side of P10: the connection's answers and what it holds back.
#[derive(Debug)]
pub(super) struct Acks {
    pub(super) answers: mpsc::Receiver<Answer>,
    /// `max_in_flight`: an answer for a sequence this far or further ahead of the oldest
    /// unacknowledged publish answers nothing in flight.
    pub(super) window: u64,
    pub(super) timeout: Duration,
    /// The oldest unacknowledged publish's deadline, armed when the acker starts waiting
    /// for its answer.
    pub(super) deadline: Pin<Box<Sleep>>,
    /// Answers that came before an older publish's (not expected from one stream, which
    /// answers in order; kept, never dropped, should a server do otherwise).
    pub(super) early: BTreeMap<u64, Result<Acked, PublishError>>,
    /// The newest publish whose answer the acker awaited (0: none yet); answers read while
    /// it awaits none are for publishes after it.
    pub(super) awaited: u64,
    /// Why the connection closed, once it did (CN3).
    pub(super) closed: Option<String>,
    /// Subjects the server denied a publish to in this session, with its words (P11).
    pub(super) denied: Vec<(String, String)>,
    /// Set once the server announced lame-duck mode (P12).
    pub(super) lame_duck: Option<()>,
    /// The server, `host:port`.
    pub(super) server: String,
}

impl Acks {
    /// The acker's side of a session's connection, `answers`, awaiting nothing yet.
    pub(super) fn new(
        answers: mpsc::Receiver<Answer>,
        options: &SinkOptions,
        server: String,
    ) -> Self {
        Acks {
            answers,
            window: options.max_in_flight.max(1) as u64,
            timeout: options.ack_timeout,
            deadline: Box::pin(tokio::time::sleep(options.ack_timeout)),
            early: BTreeMap::new(),
            awaited: 0,
            closed: None,
            denied: Vec::new(),
            lame_duck: None,
            server,
        }
    }

    /// The answer to publish `sequence` (outbox row `id`, to `subject`), the oldest
    /// unacknowledged one (P10); `Ok(Err(why))` when the server denied it (P11). A fast
    /// batch's commit (P14) is answered by the first answer to any publish of its batch,
    /// `first` to `sequence` (F3): one before the commit's ends the batch early, an error.
    pub(super) async fn next(
        &mut self,
        first: u64,
        sequence: u64,
        id: &EventId,
        subject: &str,
    ) -> Result<Result<Acked, String>, SinkError> {
        self.awaited = sequence;
        let answered = |answer_to: u64, ack: Result<Acked, PublishError>| {
            let ack = match ack {
                Ok(ack) if answer_to != sequence => Err(ended_early(answer_to - first + 1, &ack)),
                ack => ack,
            };
            ack.map(Ok).map_err(|source| SinkError::Ack {
                id: id.clone(),
                source,
            })
        };
        if !self.early.is_empty() {
            // Answers to publishes before this batch answer nothing awaited.
            self.early = self.early.split_off(&first);
            if let Some((&answer_to, _)) = self.early.range(first..=sequence).next() {
                if let Some(answer) = self.early.remove(&answer_to) {
                    return answered(answer_to, answer);
                }
            }
        }
        let mut armed = false;
        loop {
            if let Some(why) = &self.closed {
                return Err(SinkError::Closed {
                    id: id.clone(),
                    why: why.clone(),
                });
            }
            let polled = std::future::poll_fn(|cx| Poll::Ready(self.answers.poll_recv(cx))).await;
            let answer = match polled {
                Poll::Ready(answer) => answer,
                // P11: every answer read is honoured; none is for this publish, to a subject
                // the server denies: it was dropped.
                Poll::Pending if !self.denied.is_empty() => {
                    if let Some((_, why)) = self.denied.iter().find(|(s, _)| s == subject) {
                        return Ok(Err(why.clone()));
                    }
                    self.wait(&mut armed, id).await?
                }
                Poll::Pending => self.wait(&mut armed, id).await?,
            };
            let Some((answer_to, ack)) = self.note(answer) else {
                continue;
            };
            if (first..=sequence).contains(&answer_to) {
                return answered(answer_to, ack);
            }
            self.keep_early(sequence, answer_to, ack);
        }
    }

    /// What the connection said (`None`: it is gone), kept for the session (a denied
    /// subject, P11; lame-duck mode, P12; why it closed, CN3), or, for an ack, the publish
    /// it answers and the ack.
    #[inline]
    pub(super) fn note(
        &mut self,
        answer: Option<Answer>,
    ) -> Option<(u64, Result<Acked, PublishError>)> {
        match answer {
            Some(Answer::Ack { sequence, ack }) => return Some((sequence, ack)),
            Some(Answer::Denied { subject, why }) => self.denied.push((subject, why)),
            Some(Answer::LameDuck) => self.lame_duck = Some(()),
            Some(Answer::Closed(why)) => self.closed = Some(why),
            None => self.closed = Some(CONNECTION_CLOSED.into()),
        }
        None
    }

    /// Waits for the next answer, arming the oldest publish's deadline first (P10).
    pub(super) async fn wait(
        &mut self,
        armed: &mut bool,
        id: &EventId,
    ) -> Result<Option<Answer>, SinkError> {
        if !*armed {
            self.deadline.as_mut().reset(Instant::now() + self.timeout);
            *armed = true;
        }
        tokio::select! {
            biased;
            answer = self.answers.recv() => Ok(answer),
            () = self.deadline.as_mut() => Err(SinkError::Ack {
                id: id.clone(),
                source: PublishError::new(PublishErrorKind::TimedOut),
            }),
        }
    }

    /// Keeps an answer to a publish in flight (`oldest`, the oldest unacknowledged one, and
    /// the window after it) for its turn and ignores any other: no publish of this session
    /// awaits it.
    pub(super) fn keep_early(
        &mut self,
        oldest: u64,
        answer_to: u64,
        ack: Result<Acked, PublishError>,
    ) {
        if answer_to >= oldest && answer_to - oldest < self.window {
            // The first answer counts (a fast batch's message can be answered twice: a
            // refusal, then the batch's PubAck, F3).
            self.early.entry(answer_to).or_insert(ack);
        } else {
            debug!(
                oldest,
                answered = answer_to,
                "ignoring an answer no publish of this session awaits"
            );
        }
    }

    /// Reads the connection while the acker awaits no answer, keeping what comes early for
    /// the publishes after [`Acks::awaited`], until the connection closes (CN3) or the server
    /// goes into lame-duck mode (P12; nothing is in flight): returns the session's end.
    /// Cancel-safe: an answer is kept as soon as it is read.
    pub(super) async fn closed(&mut self) -> SinkError {
        loop {
            if self.lame_duck.is_some() {
                return SinkError::LameDuck {
                    server: self.server.clone(),
                };
            }
            if let Some(why) = &self.closed {
                return SinkError::Disconnected(why.clone());
            }
            let answer = self.answers.recv().await;
            if let Some((sequence, ack)) = self.note(answer) {
                // Every publish up to `awaited` is answered: the oldest in flight, if any,
                // is the next one.
                self.keep_early(self.awaited + 1, sequence, ack);
            }
        }
    }
}

/// F3: a fast batch counts only when its commit (`fast`: the batch's first publish and the
/// stream sequence the fence predicts) is stored where the fence predicts; F4: a server
/// that refuses fast batches themselves turns the mode off.
pub(super) fn fast_checked(
    answer: Result<Result<Acked, String>, SinkError>,
    fast: Option<(u64, u64)>,
    id: &EventId,
    stats: &SinkStats,
) -> Result<Result<Acked, String>, SinkError> {
    let Some((_, expect)) = fast else {
        return answer;
    };
    let answer = match answer {
        Ok(Ok(ack)) if ack.duplicate || ack.sequence != expect => Err(SinkError::Ack {
            id: id.clone(),
            source: PublishError::with_source(
                PublishErrorKind::Other,
                format!(
                    "the fast batch's commit was stored at stream sequence {}{}, not {expect}: a message of the batch was already in the stream or not stored",
                    ack.sequence,
                    if ack.duplicate { " as a duplicate" } else { "" }
                ),
            ),
        }),
        answer => answer,
    };
    if let Err(error) = &answer {
        if error
            .jetstream_code()
            .is_some_and(|code| batch::FAST_REFUSED.contains(&code))
        {
            stats.turn_fast_off(error.to_string());
        }
    }
    answer
}

/// F3: a fast batch answered by a PubAck before its commit, on its message `place`: the
/// batch ended there (a message refused, missing or a duplicate).
pub(super) fn ended_early(place: u64, ack: &Acked) -> PublishError {
    PublishError::with_source(
        PublishErrorKind::Other,
        format!(
            "the fast batch ended at its message {place} (stream sequence {}{}), before its commit: a message of it was refused, lost or already in the stream",
            ack.sequence,
            if ack.duplicate { ", a duplicate" } else { "" }
        ),
    )
}
