//! Whether a stream is a faithful copy of what the writers committed: every committed row
//! exactly once, each transaction one contiguous run in insert order with `Outbox-Tx-Index`
//! 0, 1, …, commit positions increasing, each writer's transactions in the order it
//! committed them, a commit LSN inside the bounds its writer saw, nothing that was not
//! committed, no gap in the stream's sequences; and, from [`Sample`]s taken while the relay
//! ran, that the slot never confirmed past an event that was not stored yet.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use pgoutput::Lsn;

use super::case::{sql_connect, Case};
use super::stream::Stored;
use super::writers::{Outcome, TxRecord, WriterLog};

/// How faithful a copy of the committed rows the stream is.
#[derive(Debug, Default)]
pub struct Findings {
    /// Messages in the stream.
    pub events: usize,
    /// Committed rows.
    pub committed: usize,
    /// Committed rows missing from the stream.
    pub lost: usize,
    /// Messages beyond the first for the same row.
    pub duplicated: usize,
    /// Messages beyond the first with the same `Nats-Msg-Id`.
    pub duplicated_msg_ids: usize,
    /// Order violations: the sum of the next three.
    pub reordered: usize,
    /// Messages whose (commit LSN, `Outbox-Tx-Index`) does not follow their predecessor's.
    pub out_of_position: usize,
    /// Transactions whose rows are not one contiguous run in insert order.
    pub split_transactions: usize,
    /// A writer's transaction stored before one it committed earlier.
    pub writer_order: usize,
    /// Messages for rows that were never committed: the sum of the next two.
    pub unexpected: usize,
    /// Messages for rows whose transaction was rolled back (or cut off).
    pub rolled_back_published: usize,
    /// Messages for rows no writer wrote.
    pub unknown_published: usize,
    /// Transactions whose commit LSN lies outside the [before COMMIT, after COMMIT) bounds
    /// their writer saw.
    pub commit_lsn_outside_bounds: usize,
    /// Stream sequences that are not 1, 2, 3, …
    pub sequence_gaps: usize,
    /// Samples (C, S) after which an event with a commit LSN below C was stored after S.
    pub confirmed_past_unstored: usize,
    /// The first few problems, described.
    pub problems: Vec<String>,
}

impl Findings {
    fn note(&mut self, problem: String) {
        if self.problems.len() < 30 {
            self.problems.push(problem);
        }
    }

    pub fn is_faithful(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.duplicated_msg_ids == 0
            && self.reordered == 0
            && self.unexpected == 0
            && self.commit_lsn_outside_bounds == 0
            && self.sequence_gaps == 0
            && self.confirmed_past_unstored == 0
            && self.events == self.committed
    }

    pub fn summary(&self) -> String {
        format!(
            "events {}, committed {}, lost {}, duplicated {} (by Nats-Msg-Id {}), reordered {} \
             (out of position {}, split transactions {}, writer order {}), unexpected {} \
             (rolled back {}, unknown {}), commit LSN outside the writer's bounds {}, \
             sequence gaps {}, samples confirming past an unstored event {}",
            self.events,
            self.committed,
            self.lost,
            self.duplicated,
            self.duplicated_msg_ids,
            self.reordered,
            self.out_of_position,
            self.split_transactions,
            self.writer_order,
            self.unexpected,
            self.rolled_back_published,
            self.unknown_published,
            self.commit_lsn_outside_bounds,
            self.sequence_gaps,
            self.confirmed_past_unstored,
        )
    }

    /// Panics with the summary and the first problems unless the copy is faithful.
    pub fn assert_faithful(&self) {
        assert!(
            self.is_faithful(),
            "the stream is not a faithful copy: {}\n{}",
            self.summary(),
            self.problems.join("\n")
        );
    }
}

/// [`check_stream`] without samples.
pub fn check_faithful(messages: &[Stored], log: &WriterLog) -> Findings {
    check_stream(messages, log, &[])
}

/// Compares a fresh stream's `messages` with what the writers did (`log`) and with the
/// slot's confirmed positions sampled while the relay ran: see the module docs.
pub fn check_stream(messages: &[Stored], log: &WriterLog, samples: &[Sample]) -> Findings {
    let mut findings = Findings {
        events: messages.len(),
        committed: log.committed_rows(),
        ..Findings::default()
    };
    let first_position = check_once(&mut findings, messages, log);
    check_positions(&mut findings, messages);
    check_transactions(&mut findings, messages, log, &first_position);
    check_samples(&mut findings, messages, samples);
    findings.reordered =
        findings.out_of_position + findings.split_transactions + findings.writer_order;
    findings.unexpected = findings.rolled_back_published + findings.unknown_published;
    findings
}

/// Exactly once, nothing else, no sequence gap; returns where each id is first stored.
fn check_once(
    findings: &mut Findings,
    messages: &[Stored],
    log: &WriterLog,
) -> HashMap<i64, usize> {
    let committed = log.committed_ids();
    let rolled_back: HashSet<i64> = log.rolled_back.iter().copied().collect();
    let mut first_position: HashMap<i64, usize> = HashMap::new();
    let mut msg_ids: HashSet<&str> = HashSet::new();
    for (i, message) in messages.iter().enumerate() {
        let id = message.outbox_id();
        if let Entry::Vacant(entry) = first_position.entry(id) {
            entry.insert(i);
        } else {
            findings.duplicated += 1;
            findings.note(format!("seq {}: id {id} again", message.sequence));
        }
        if !msg_ids.insert(message.header("Nats-Msg-Id")) {
            findings.duplicated_msg_ids += 1;
        }
        if !committed.contains(&id) {
            let what = if rolled_back.contains(&id) {
                findings.rolled_back_published += 1;
                "never committed"
            } else {
                findings.unknown_published += 1;
                "never written"
            };
            findings.note(format!("seq {}: id {id} was {what}", message.sequence));
        }
        // A fresh stream: sequences 1, 2, … with nothing missing.
        if message.sequence != i as u64 + 1 {
            findings.sequence_gaps += 1;
            findings.note(format!(
                "seq {} where {} was expected",
                message.sequence,
                i + 1
            ));
        }
    }
    for id in committed
        .iter()
        .filter(|id| !first_position.contains_key(id))
    {
        findings.lost += 1;
        findings.note(format!("id {id} (committed) is not in the stream"));
    }
    first_position
}

/// Commit order: (commit LSN, tx index) steps from one event to the next.
fn check_positions(findings: &mut Findings, messages: &[Stored]) {
    for (i, message) in messages.iter().enumerate() {
        let (lsn, index) = (message.commit_lsn(), message.tx_index());
        let follows = match i.checked_sub(1).map(|p| &messages[p]) {
            None => index == 0,
            Some(previous) => {
                let (plsn, pindex) = (previous.commit_lsn(), previous.tx_index());
                (lsn > plsn && index == 0) || (lsn == plsn && index == pindex + 1)
            }
        };
        if !follows {
            findings.out_of_position += 1;
            findings.note(format!(
                "seq {}: position ({lsn}, {index}) does not follow its predecessor",
                message.sequence
            ));
        }
    }
}

/// Each committed transaction: one contiguous run in insert order, with one commit LSN
/// inside the bounds its writer saw; each writer's transactions in its commit order.
fn check_transactions(
    findings: &mut Findings,
    messages: &[Stored],
    log: &WriterLog,
    first_position: &HashMap<i64, usize>,
) {
    let mut last_of_writer: HashMap<usize, (usize, usize)> = HashMap::new();
    let mut committed: Vec<&TxRecord> = log
        .transactions
        .iter()
        .filter(|r| r.outcome == Outcome::Committed)
        .collect();
    committed.sort_by_key(|r| (r.writer, r.seq));
    for record in committed {
        let Some(&start) = record.ids.first().and_then(|id| first_position.get(id)) else {
            continue;
        };
        let run = &messages[start..(start + record.ids.len()).min(messages.len())];
        let run_ids: Vec<i64> = run.iter().map(Stored::outbox_id).collect();
        if run_ids != record.ids {
            findings.split_transactions += 1;
            findings.note(format!(
                "writer {} transaction {} ({} rows) is not one run in insert order from seq {}",
                record.writer,
                record.seq,
                record.ids.len(),
                messages[start].sequence
            ));
        }
        let lsn = messages[start].commit_lsn();
        let inside = record.before_commit.is_none_or(|b| b <= lsn)
            && record.after_commit.is_none_or(|a| lsn < a)
            && run.iter().all(|m| m.commit_lsn() == lsn);
        if !inside {
            findings.commit_lsn_outside_bounds += 1;
            findings.note(format!(
                "writer {} transaction {}: commit LSN {lsn} outside [{:?}, {:?})",
                record.writer, record.seq, record.before_commit, record.after_commit
            ));
        }
        if let Some(&(previous_seq, previous_start)) = last_of_writer.get(&record.writer) {
            if previous_start > start {
                findings.writer_order += 1;
                findings.note(format!(
                    "writer {}: transaction {} stored before its transaction {previous_seq}",
                    record.writer, record.seq
                ));
            }
        }
        last_of_writer.insert(record.writer, (record.seq, start));
    }
}

/// The slot never confirmed past an event that was not stored: for every sample (C, S),
/// every event with commit LSN < C has stream sequence <= S.
fn check_samples(findings: &mut Findings, messages: &[Stored], samples: &[Sample]) {
    let mut by_lsn: Vec<(Lsn, u64)> = messages
        .iter()
        .map(|m| (m.commit_lsn(), m.sequence))
        .collect();
    by_lsn.sort();
    let mut highest_sequence = Vec::with_capacity(by_lsn.len());
    let mut highest = 0;
    for &(_, sequence) in &by_lsn {
        highest = highest.max(sequence);
        highest_sequence.push(highest);
    }
    for sample in samples {
        let before = by_lsn.partition_point(|&(lsn, _)| lsn < sample.confirmed);
        if before > 0 && highest_sequence[before - 1] > sample.last_sequence {
            findings.confirmed_past_unstored += 1;
            findings.note(format!(
                "the slot confirmed {} while the stream's last sequence was {}, but an event before it is at sequence {}",
                sample.confirmed,
                sample.last_sequence,
                highest_sequence[before - 1]
            ));
        }
    }
}

/// The slot's `confirmed_flush_lsn` and, read right after it, the stream's last sequence.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub confirmed: Lsn,
    pub last_sequence: u64,
}

/// Takes a [`Sample`] every ~100 ms until stopped, through server restarts (a sample is
/// skipped while either server cannot answer).
#[derive(Debug)]
pub struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    /// Starts sampling the case's slot and stream (`js` should time out its requests
    /// quickly, so that a restarting server only costs a sample).
    pub fn start(case: &Case, js: jetstream::Context) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(sample_until(
            case.pg_url.clone(),
            case.slot.clone(),
            case.stream.clone(),
            js,
            stop.clone(),
        ));
        Sampler { stop, task }
    }

    /// Stops sampling; returns the samples in the order they were taken.
    pub async fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("sampler task")
    }
}

async fn sample_until(
    url: String,
    slot: String,
    stream: String,
    js: jetstream::Context,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut client: Option<tokio_postgres::Client> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let Some(sql) = client.as_ref().filter(|c| !c.is_closed()) else {
            client = sql_connect(&url).await.ok();
            continue;
        };
        let confirmed = tokio::time::timeout(
            Duration::from_secs(2),
            sql.query_opt(
                "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = $1",
                &[&slot],
            ),
        )
        .await;
        let confirmed = match confirmed {
            Ok(Ok(Some(row))) => match row.get::<_, Option<String>>(0) {
                Some(text) => text.parse().expect("an LSN"),
                None => continue,
            },
            Ok(Ok(None)) => continue,
            _ => {
                client = None;
                continue;
            }
        };
        // Strictly after the slot's position was read.
        let Ok(info) = js.get_stream(&stream).await else {
            continue;
        };
        samples.push(Sample {
            confirmed,
            last_sequence: info.cached_info().state.last_sequence,
        });
    }
    samples
}
