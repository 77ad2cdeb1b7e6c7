//! Reporting: the problems found, by outbox id, counted by kind and told on one line each
//! ([`Report`]), with the exit status they give.

use super::*;

/// One problem found, by outbox id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `missing`, `duplicated`, `mismatched`, `out of order`, `unexpected`, `unpublishable`
    /// or `dead-lettered` (not a discrepancy, VER3).
    pub kind: &'static str,
    /// The outbox id.
    pub id: EventId,
    /// What is wrong, with stream sequences.
    pub detail: String,
}

/// The order problems are reported in (VER6): discrepancies first, `dead-lettered` last.
pub(super) const KINDS: [&str; 7] = [
    "missing",
    "duplicated",
    "mismatched",
    "out of order",
    "unexpected",
    "unpublishable",
    "dead-lettered",
];

pub(super) fn rank(kind: &str) -> usize {
    KINDS.iter().position(|k| *k == kind).unwrap_or(KINDS.len())
}

/// What verify found.
#[derive(Debug, Default)]
pub struct Report {
    /// Rows checked.
    pub rows: u64,
    /// Rows in range left out by design when the slot was created (VER6).
    pub left_out: u64,
    /// The lowest and highest id left out.
    pub left_out_ids: Option<(i64, i64)>,
    /// The slot's boundary as read (`None`: not read, the range held no row).
    pub boundary: Option<crate::postgres::boundary::Read>,
    /// The slot's name, for the report.
    pub slot: String,
    /// Messages read from the stream.
    pub messages: u64,
    /// The lowest and highest id checked.
    pub ids: Option<(EventId, EventId)>,
    /// Rows in range of an event type the mapping's filter excludes: never published, not
    /// checked.
    pub excluded: u64,
    /// Event messages of this database's relay whose rows are gone, between the lowest and
    /// highest id in the table (VER7).
    pub deleted: u64,
    /// The lowest and highest of those ids.
    pub deleted_ids: Option<(EventId, EventId)>,
    /// The same, with ids below the lowest or above the highest id in the table (all of
    /// them, for an empty table).
    pub deleted_outside: u64,
    /// Every problem, by kind then id.
    pub problems: Vec<Problem>,
    /// How long it took.
    pub elapsed: Duration,
}

impl Report {
    /// Problems of `kind`.
    pub fn count(&self, kind: &str) -> usize {
        self.problems.iter().filter(|p| p.kind == kind).count()
    }

    /// 0 consistent, [`DISCREPANCIES_EXIT`] otherwise (VER5).
    pub fn exit_code(&self) -> u8 {
        if self.problems.iter().any(|p| p.kind != "dead-lettered") {
            DISCREPANCIES_EXIT
        } else {
            0
        }
    }

    /// The problems (at most `max_listed` per kind, discrepancies first), what was left
    /// out and why, and the summary line (VER6).
    pub fn render(&self, max_listed: usize) -> String {
        let mut out = String::new();
        self.render_problems(&mut out, max_listed);
        self.render_left_out(&mut out);
        self.render_deleted(&mut out);
        self.render_summary(&mut out);
        out
    }

    /// The problems, at most `max_listed` per kind, discrepancies first.
    pub(super) fn render_problems(&self, out: &mut String, max_listed: usize) {
        let mut problems: Vec<&Problem> = self.problems.iter().collect();
        problems.sort_by(|a, b| rank(a.kind).cmp(&rank(b.kind)).then(a.id.cmp(&b.id)));
        for kind in problems.chunk_by(|a, b| a.kind == b.kind) {
            for problem in kind.iter().take(max_listed) {
                let _ = writeln!(
                    out,
                    "{}: id={} {}",
                    problem.kind,
                    shown_id(&problem.id),
                    problem.detail
                );
            }
            if kind.len() > max_listed {
                let _ = writeln!(
                    out,
                    "{}: ... and {} more",
                    kind[0].kind,
                    kind.len() - max_listed
                );
            }
        }
    }

    /// What the slot's creation left out (VER6), or why every row is expected; the rows the
    /// event-type filter excludes.
    pub(super) fn render_left_out(&self, out: &mut String) {
        if self.excluded > 0 {
            let _ = writeln!(
                out,
                "excluded: {} rows of event types the filter excludes (--include-event-types, \
                 --exclude-event-types): never published, not checked",
                self.excluded
            );
        }
        match &self.boundary {
            Some(crate::postgres::boundary::Read::Recorded(boundary)) if self.left_out > 0 => {
                let ids = self
                    .left_out_ids
                    .map_or_else(String::new, |(lo, hi)| format!(" (ids {lo}..={hi})"));
                let _ = writeln!(
                    out,
                    "left out: {} rows{ids}, already published when slot {:?} was created with --backfill {} \
                     (it streams from {}): by design not the relay's, not checked",
                    self.left_out, self.slot, boundary.mode, boundary.consistent_point
                );
            }
            Some(crate::postgres::boundary::Read::Absent(why)) if self.count("missing") > 0 => {
                let _ = writeln!(
                    out,
                    "note: no boundary is recorded for slot {:?} ({why}), so every row is expected: \
                     rows committed before the slot was created and never backfilled (a slot created by an \
                     older relay, with --backfill none, or by hand) are reported missing; \
                     verify from the first relayed id (--from-id) to leave them out",
                    self.slot
                );
            }
            _ => {}
        }
    }

    /// VER7: the messages whose rows were deleted after relaying, one line.
    pub(super) fn render_deleted(&self, out: &mut String) {
        if self.deleted + self.deleted_outside == 0 {
            return;
        }
        let within = self
            .deleted_ids
            .as_ref()
            .map_or_else(String::new, |(low, high)| {
                format!(
                    ", {} of them with ids {}..={} among the table's",
                    self.deleted,
                    shown_id(low),
                    shown_id(high)
                )
            });
        let _ = writeln!(
            out,
            "rows deleted after relaying: {} messages of this database's relay whose rows are no longer \
             in the table{within}: not checked (a clean-up, retention, Debezium's remove-after-insert, \
             TRUNCATE or a dropped partition deletes rows after they are relayed; the stream keeps them)",
            self.deleted + self.deleted_outside
        );
    }

    /// The summary line: the verdict (VER5) and each kind's count.
    pub(super) fn render_summary(&self, out: &mut String) {
        let seconds = self.elapsed.as_secs_f64();
        let rate = if seconds > 0.0 {
            self.rows as f64 / seconds
        } else {
            0.0
        };
        let ids = self.ids.as_ref().map_or_else(
            || "none".to_owned(),
            |(lo, hi)| format!("{}..={}", shown_id(lo), shown_id(hi)),
        );
        let verdict = if self.exit_code() == 0 {
            "OK".to_owned()
        } else {
            format!("DISCREPANCIES (exit {DISCREPANCIES_EXIT})")
        };
        let _ = writeln!(
            out,
            "verify: {verdict}: {} rows (ids {ids}), {} stream messages, {:.1} s ({:.0} rows/s): \
             {} missing, {} duplicated, {} mismatched, {} out of order, {} unexpected, \
             {} unpublishable, {} dead-lettered, {} left out",
            self.rows,
            self.messages,
            seconds,
            rate,
            self.count("missing"),
            self.count("duplicated"),
            self.count("mismatched"),
            self.count("out of order"),
            self.count("unexpected"),
            self.count("unpublishable"),
            self.count("dead-lettered"),
            self.left_out,
        );
    }
}
