//! Judging: each row against the message the stream holds for it, the messages no row
//! explains, and why a message differs (VER2-VER7).

use super::*;

/// The judge of one checked row's entry: what is wrong with it, if anything (VER3: a
/// dead-letter record in its place is reported as dead-lettered, not missing).
pub(super) fn judge_entry(
    row: &Expected,
    entry: Entry,
    why: impl FnOnce() -> String,
) -> Option<Problem> {
    let problem = |kind, detail| {
        Some(Problem {
            kind,
            id: row.id.clone(),
            detail,
        })
    };
    if row.state == Expected::UNPUBLISHABLE {
        let why = why();
        return if entry.count > 0 {
            problem(
                "unpublishable",
                format!("{why}, yet the stream holds it at sequence {}", entry.seq),
            )
        } else if entry.dead_letters == 0 {
            problem(
                "unpublishable",
                format!("{why}: the relay cannot publish it (it halts or dead-letters it)"),
            )
        } else {
            None
        };
    }
    if entry.count > 0 {
        return None;
    }
    if entry.dead_letters > 0 {
        problem(
            "dead-lettered",
            format!(
                "a dead-letter record at sequence {} in its place",
                entry.seq
            ),
        )
    } else {
        problem("missing", "no message on the stream".into())
    }
}

/// The rows against the stream: marks each row's entry ([`ROW`], [`IN_RANGE`]), counts the
/// rows checked and left out (VER6) into `report`, and returns the problems found and the
/// ids (with sequences) whose first copy's digest differs from the row's.
pub(super) fn judge_rows(
    table: TableSide,
    index: &mut Index,
    report: &mut Report,
) -> (Vec<Problem>, Vec<(EventId, u64)>) {
    let mut unpublishable = table.unpublishable.into_iter().collect::<HashMap<_, _>>();
    let mut mismatched: Vec<(EventId, u64)> = vec![];
    let mut problems = vec![];
    for row in table.expected {
        let id = &row.id;
        let entry = index.get(id);
        entry.flags |= ROW;
        if row.state == Expected::OUT_OF_RANGE {
            continue;
        }
        if row.state == Expected::EXCLUDED {
            report.excluded += 1;
            continue;
        }
        if row.state == Expected::LEFT_OUT {
            report.left_out += 1;
            if let Some(id) = id.as_int() {
                let (lo, hi) = report.left_out_ids.get_or_insert((id, id));
                (*lo, *hi) = ((*lo).min(id), (*hi).max(id));
            }
            continue;
        }
        entry.flags |= IN_RANGE;
        report.rows += 1;
        let entry = *entry;
        let why = || unpublishable.remove(id).unwrap_or_default();
        if let Some(problem) = judge_entry(&row, entry, why) {
            problems.push(problem);
        } else if row.state == Expected::PUBLISHABLE
            && entry.count > 0
            && row.digest != entry.digest
        {
            mismatched.push((row.id, entry.seq));
        }
    }
    (problems, mismatched)
}

/// The ids in the range the stream holds more than once, each with every sequence.
fn duplicated(index: &Index, duplicates: Vec<(EventId, u64)>) -> Vec<Problem> {
    let mut duplicated: HashMap<EventId, Vec<u64>> = HashMap::new();
    for (id, seq) in duplicates {
        if index.peek(&id).flags & IN_RANGE != 0 {
            duplicated.entry(id).or_default().push(seq);
        }
    }
    duplicated
        .into_iter()
        .map(|(id, seqs)| {
            let entry = index.peek(&id);
            Problem {
                kind: "duplicated",
                id,
                detail: format!(
                    "{} messages on the stream: sequences {}",
                    entry.count,
                    std::iter::once(entry.seq)
                        .chain(seqs)
                        .map(|s| s.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        })
        .collect()
}

/// Duplicates, order and ids on the stream without a row, for the rows in range; ids
/// without a row only when the whole table was read (`whole_table`).
pub(super) fn judge_stream(
    index: &Index,
    duplicates: Vec<(EventId, u64)>,
    out_of_order: Vec<(EventId, String)>,
    whole_table: bool,
    report: &mut Report,
    problems: &mut Vec<Problem>,
) {
    let in_range = |id: &EventId| index.peek(id).flags & IN_RANGE != 0;
    problems.extend(duplicated(index, duplicates));
    for (id, detail) in out_of_order {
        if in_range(&id) {
            problems.push(Problem {
                kind: "out of order",
                id,
                detail,
            });
        }
    }
    if whole_table {
        index.for_each(|id, entry| {
            if entry.flags & (ROW | OURS) == OURS && entry.count > 0 {
                // VER7: deleted after relaying.
                report.deleted += 1;
                report.deleted_ids = Some(match report.deleted_ids.take() {
                    Some((low, high)) => (low.min(id.clone()), high.max(id)),
                    None => (id.clone(), id),
                });
            } else if entry.flags & ROW == 0 && (entry.count > 0 || entry.dead_letters > 0) {
                problems.push(Problem {
                    kind: "unexpected",
                    id,
                    detail: format!(
                        "at sequence {}: no row has this id, and the message is not this database's relay's \
                         (another database, slot or writer)",
                        entry.seq
                    ),
                });
            }
        });
    }
}

/// Step 4: which field differs, for the mismatches: the row and the message read again.
pub(super) async fn explain_mismatches(
    opened: &Opened,
    config: &Config,
    mismatched: Vec<(EventId, u64)>,
) -> Result<Vec<Problem>> {
    let reader = &opened.reader;
    let one_row = format!(
        "SELECT {} FROM {} WHERE {} = $1::text::{}",
        reader.select(),
        config.table,
        reader.id_column(),
        reader.id_kind().sql_type()
    );
    let mut problems = vec![];
    for (id, seq) in mismatched {
        let row = opened
            .client
            .query_one(&one_row, &[&id.to_string()])
            .await
            .map_err(read_error("cannot read the outbox table"))?;
        let detail = match (
            reader.event(&row, NO_POSITION),
            opened.stream.get_raw_message(seq).await,
        ) {
            (Ok(Some(event)), Ok(stored)) => describe_mismatch(
                &event,
                stored.subject.as_str(),
                &stored.headers,
                &stored.payload,
                seq,
            ),
            (Ok(None), _) => format!(
                "at sequence {seq}: the row changed while verify ran (its event type is now excluded)"
            ),
            (Err(e), _) => {
                format!(
                    "at sequence {seq}: the row changed while verify ran ({})",
                    e.kind
                )
            }
            (_, Err(e)) => {
                format!("at sequence {seq}: differs from the row (cannot fetch it again: {e})")
            }
        };
        problems.push(Problem {
            kind: "mismatched",
            id,
            detail,
        });
    }
    Ok(problems)
}
/// Which fields of a stored message differ from the row's event (payloads are not printed).
pub(super) fn describe_mismatch(
    event: &OutboxEvent,
    subject: &str,
    headers: &HeaderMap,
    payload: &[u8],
    seq: u64,
) -> String {
    let stored = Fields::of_message(subject, headers);
    let expected = Fields::of_event(event);
    let mut differences: Vec<String> = stored
        .named()
        .iter()
        .zip(expected.named())
        .filter(|((_, a), (_, b))| a != b)
        .map(|((name, a), (_, b))| format!("{name} is {a:?}, the row gives {b:?}"))
        .collect();
    if payload != event.payload.as_ref() {
        differences.push(format!(
            "the payload differs ({} bytes stored, {} in the row)",
            payload.len(),
            event.payload.len()
        ));
    }
    if differences.is_empty() {
        differences.push("differs from the row".into());
    }
    format!("at sequence {seq}: {}", differences.join("; "))
}
