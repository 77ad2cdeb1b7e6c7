//! The rows of the outbox table in a range, in id order, as the events the relay would
//! publish for them: what a backfill reads, at slot creation (`crate::setup::backfill`) and on
//! an existing slot (`crate::commands::backfill`). The invariants are the backfill's
//! (`crate::setup::backfill` BF2, BF4).

use outbox::{EventId, OutboxEvent, Position, Role};
use pgoutput::Lsn;
use replication::quote_literal;
use tokio_postgres::Client;
use tracing::info;

use crate::config::Config;
use crate::error::{RelayError, Result};
use crate::postgres::error::{describe, is_transient};
use crate::postgres::rows::RowReader;

/// Rows fetched from the cursor at a time.
pub const FETCH_ROWS: usize = 1000;
/// The cursor's name.
const CURSOR: &str = "outbox_relay_backfill";

/// A time bound as SQL: a duration ago (`6h`, as `replay` and `verify` take it) or a
/// timestamp Postgres reads.
fn time_sql(text: &str) -> String {
    match crate::config::parse_duration(text) {
        Ok(ago) => format!(
            "now() - {}::interval",
            quote_literal(&format!("{} milliseconds", ago.as_millis()))
        ),
        Err(_) => format!("{}::timestamptz", quote_literal(text)),
    }
}

/// Which rows to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only rows whose `status` is `'pending'`.
    pub pending_only: bool,
    /// `id >= from_id`, as text (compared as the id column's type, `stored` ROW2).
    pub from_id: Option<String>,
    /// `id <= to_id`.
    pub to_id: Option<String>,
    /// `created_at >= since` (a timestamp Postgres parses, e.g. RFC 3339, or a duration ago).
    pub since: Option<String>,
    /// `created_at < until`.
    pub until: Option<String>,
}

impl Filter {
    /// The `WHERE` clause (empty for every row) on the mapped id and creation-time columns
    /// (`status` keeps its name).
    fn where_sql(&self, config: &Config, reader: &RowReader) -> String {
        let mut conditions = Vec::new();
        if self.pending_only {
            conditions.push("status = 'pending'".to_owned());
        }
        let id = reader.id_ordered();
        if let Some(from) = &self.from_id {
            conditions.push(format!("{id} >= {}", reader.id_literal(from)));
        }
        if let Some(to) = &self.to_id {
            conditions.push(format!("{id} <= {}", reader.id_literal(to)));
        }
        let created_at = replication::quote_identifier(config.mapping.column(Role::CreatedAt));
        if let Some(since) = &self.since {
            conditions.push(format!("{created_at} >= {}", time_sql(since)));
        }
        if let Some(until) = &self.until {
            conditions.push(format!("{created_at} < {}", time_sql(until)));
        }
        if conditions.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", conditions.join(" AND "))
        }
    }
}

/// BF2: a backfilled row's position, before every streamed event: by its id for an integer
/// id, else by `ordinal`, its place in the backfill's id order.
pub fn position_of(id: &EventId, ordinal: u32) -> Result<Position> {
    match id {
        EventId::Int(id) => position(*id),
        EventId::Text(_) => Ok(Position {
            commit_lsn: Lsn::ZERO,
            index: ordinal,
        }),
    }
}

/// BF2: an integer id's backfilled position, before every streamed event.
pub fn position(id: i64) -> Result<Position> {
    u32::try_from(id)
        .map(|index| Position {
            commit_lsn: Lsn::ZERO,
            index,
        })
        .map_err(|_| {
            RelayError::permanent(anyhow::anyhow!(
                "outbox row id={id} cannot be backfilled: backfilled rows are positioned by their id, up to {}; start with --backfill none and load older rows with `outbox-relay backfill` into a shared stream",
                u32::MAX
            ))
        })
}

pub(crate) fn sql_error(what: &str, error: tokio_postgres::Error) -> RelayError {
    // 22021: a row holds bytes that are not UTF-8 (a SQL_ASCII database); every retry reads
    // the same row.
    let not_utf8 =
        error.code() == Some(&tokio_postgres::error::SqlState::CHARACTER_NOT_IN_REPERTOIRE);
    let transient = !not_utf8 && is_transient(&error);
    let mut text = format!("{what}: {}", describe(&error));
    if not_utf8 {
        text.push_str(
            ": a row of the range holds text that is not valid UTF-8 (a SQL_ASCII database stores any bytes), \
             which the relay never publishes; repair or delete that row, or leave it out of the range",
        );
    }
    if transient {
        RelayError::transient(anyhow::anyhow!(text))
    } else {
        RelayError::permanent(anyhow::anyhow!(text))
    }
}

/// The selected rows in id order, [`FETCH_ROWS`] at a time, as events (BF2, BF4). Runs in the
/// caller's open transaction.
pub struct Cursor<'a> {
    client: &'a Client,
    reader: RowReader,
    /// The last ordinal given (BF2: uuid and text ids).
    pub ordinal: u32,
    /// How many rows the filter selects.
    pub total: u64,
}

impl std::fmt::Debug for Cursor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cursor")
            .field("ordinal", &self.ordinal)
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

impl<'a> Cursor<'a> {
    pub async fn open(
        client: &'a Client,
        config: &'a Config,
        reader: RowReader,
        filter: &Filter,
    ) -> Result<Cursor<'a>> {
        let from = format!(
            "{}{}",
            config.table.sql(),
            filter.where_sql(config, &reader)
        );
        // The replication session's rendering of timestamps (outbox::timestamp) and bytea.
        client
            .batch_execute(
                "SET LOCAL TimeZone = 'UTC'; SET LOCAL DateStyle = 'ISO'; SET LOCAL bytea_output = 'hex'",
            )
            .await
            .map_err(|e| sql_error("cannot prepare the backfill's session", e))?;
        let total: i64 = client
            .query_one(&format!("SELECT count(*) FROM {from}"), &[])
            .await
            .map_err(|e| sql_error("cannot count the rows to backfill", e))?
            .get(0);
        client
            .batch_execute(&format!(
                "DECLARE {CURSOR} NO SCROLL CURSOR FOR SELECT {} FROM {from} ORDER BY {}",
                reader.select(),
                reader.order_by()
            ))
            .await
            .map_err(|e| sql_error("cannot read the outbox table", e))?;
        info!(table = %config.table, rows = total, "backfilling rows in id order");
        Ok(Cursor {
            client,
            reader,
            ordinal: 0,
            total: u64::try_from(total).unwrap_or(0),
        })
    }

    pub async fn next(&mut self) -> Result<Option<Vec<OutboxEvent>>> {
        let rows = self
            .client
            .query(&format!("FETCH {FETCH_ROWS} FROM {CURSOR}"), &[])
            .await
            .map_err(|e| sql_error("cannot read the outbox table", e))?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut events = Vec::with_capacity(rows.len());
        for row in rows {
            let Some(id) = self.reader.id_of(&row) else {
                return Err(RelayError::permanent(anyhow::anyhow!(
                    "an outbox row's id cannot be read as the id column's type"
                )));
            };
            self.ordinal = self.ordinal.checked_add(1).ok_or_else(|| {
                RelayError::permanent(anyhow::anyhow!(
                    "more than {} rows to backfill: positions are exhausted",
                    u32::MAX
                ))
            })?;
            let position = position_of(&id, self.ordinal)?;
            match self.reader.event(&row, position) {
                Ok(Some(event)) => events.push(event),
                // Excluded by the event-type filter: never published (BF2).
                Ok(None) => {}
                Err(e) => {
                    return Err(RelayError::permanent(anyhow::anyhow!(
                        "{e}, so no event can be derived from it: fill it in, or backfill a range without it"
                    )))
                }
            }
        }
        Ok(Some(events))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backfilled_rows_precede_streamed_events_in_id_order() {
        let first = position(1).ok();
        let later = position(2).ok();
        assert!(first < later);
        let streamed = Position {
            commit_lsn: Lsn(0x0100_0000),
            index: 0,
        };
        assert!(position(i64::from(u32::MAX)).ok() < Some(streamed));
        assert!(position(i64::from(u32::MAX) + 1).is_err());
        assert!(position(-1).is_err());
    }

    #[test]
    fn filters_select_pending_rows_and_ranges() {
        let config = crate::config::tests::load_url("postgres://u@h/db").unwrap();
        let seed = crate::postgres::rows::test_reader(&config, outbox::event::oid::INT8);
        assert_eq!(Filter::default().where_sql(&config, &seed), "");
        let filter = Filter {
            pending_only: true,
            from_id: Some("3".into()),
            to_id: Some("9".into()),
            since: Some("2026-01-01T00:00:00Z".into()),
            until: Some("x'y".into()),
        };
        assert_eq!(
            filter.where_sql(&config, &seed),
            " WHERE status = 'pending' AND \"id\" >= '3'::int8 AND \"id\" <= '9'::int8 AND \"created_at\" >= '2026-01-01T00:00:00Z'::timestamptz AND \"created_at\" < 'x''y'::timestamptz"
        );
        let text = crate::postgres::rows::test_reader(&config, outbox::event::oid::TEXT);
        for (filter, reader, sql) in [
            // Text ids compare by their bytes (stored ROW2).
            (
                Filter {
                    from_id: Some("evt'1".into()),
                    ..Filter::default()
                },
                &text,
                " WHERE \"id\" COLLATE \"C\" >= ('evt''1'::text COLLATE \"C\")",
            ),
            // A duration ago, as replay and verify take it.
            (
                Filter {
                    since: Some("1h30m".into()),
                    ..Filter::default()
                },
                &seed,
                " WHERE \"created_at\" >= now() - '5400000 milliseconds'::interval",
            ),
        ] {
            assert_eq!(filter.where_sql(&config, reader), sql);
        }
    }

    #[test]
    fn non_integer_ids_are_positioned_by_their_ordinal() {
        let id = EventId::Text("b".into());
        assert_eq!(position_of(&id, 7).ok().map(|p| p.index), Some(7));
        assert_eq!(
            position_of(&EventId::Int(5), 7).ok().map(|p| p.index),
            Some(5)
        );
    }
}
