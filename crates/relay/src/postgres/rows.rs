//! Reading outbox rows as the relay reads them, for the tools that compare the table with the
//! stream (verify, replay, backfill, marking, retention). Streaming reads no row: a session
//! resumes by comparing its replay with the stream, never with the table (`sink::resume` S2,
//! S4), since outbox tables are emptied by design.
//!
//! # Invariants
//! - ROW1 A row that cannot be read as the relay would read it (a NULL key column, an
//!   infinite `created_at`) yields no event ([`RowReader::event`]).
//! - ROW2 Rows read in id order ([`RowReader::order_by`]) come in one stable order for every
//!   id kind: integers and uuids by value, text ids by their bytes (`COLLATE "C"`), which is
//!   the order `outbox::EventId`'s `Ord` gives the same ids (a uuid's lower-case text sorts
//!   as its bytes do; Rust compares strings by their UTF-8 bytes, as `"C"` does).

use bytes::Bytes;
use outbox::{EventBuilder, EventId, IdKind, OutboxColumns, OutboxEvent, Position};
use tokio_postgres::Client;

use crate::config::Config;
use crate::error::{RelayError, Result};

/// The refusal of a tool that publishes rows (`replay`, `backfill`) when the range holds
/// none: outbox tables are emptied by design, so rows relayed before may be gone, and the
/// tool says so rather than reporting success for nothing (exit 2).
pub fn no_rows_in_range(table: &impl std::fmt::Display, tool: &str) -> RelayError {
    RelayError::setup(anyhow::anyhow!(
        "{tool}: table {table} holds no row in the range given, so there is nothing to publish: \
         the rows were deleted after they were relayed (a clean-up, retention, Debezium's \
         remove-after-insert, TRUNCATE, a dropped partition) or never existed. {tool} publishes \
         rows the table still holds; the events the relay published stay in the stream (read \
         them there, e.g. with a consumer from a start sequence or time)"
    ))
}

/// Reads rows of the table as the relay reads them (ROW1): the mapped columns, each as text
/// (`bytea` as its hex output, which the control session pins), through the builder
/// streaming uses (`outbox` E4), so a row read back yields exactly the event streaming
/// derived.
/// Rows in id order come in one stable order for every id kind (ROW2).
#[derive(Debug)]
pub struct RowReader {
    builder: EventBuilder,
    select: String,
    id_column: String,
    id_kind: IdKind,
}

impl RowReader {
    /// A reader for `columns` (the mapping resolved against the table) under `config`,
    /// which leaves the payload out (the checks of what is stored compare no payload, and a
    /// payload that is not UTF-8, in a SQL_ASCII database, must not stop them).
    pub fn new(config: &Config, columns: OutboxColumns) -> RowReader {
        Self::reading(config, columns, false)
    }

    /// A reader that reads the payload too: the whole event (verify, replay, backfill).
    pub fn with_payload(config: &Config, columns: OutboxColumns) -> RowReader {
        Self::reading(config, columns, true)
    }

    fn reading(config: &Config, columns: OutboxColumns, payload: bool) -> RowReader {
        let payload_column = config.mapping.column(outbox::Role::Payload);
        // Each under a name of its own: an output column named like the id column would
        // be what `ORDER BY id` sorts by (as text), not the column.
        let select = columns
            .read_columns()
            .enumerate()
            .map(|(i, c)| {
                if c == payload_column && !payload {
                    // An empty payload of the column's kind (a bytea's is `\x`).
                    match columns.payload_kind() {
                        outbox::PayloadKind::Bytes => format!("'\\x'::text AS outbox_relay_{i}"),
                        outbox::PayloadKind::Text => format!("''::text AS outbox_relay_{i}"),
                    }
                } else {
                    format!(
                        "{}::text AS outbox_relay_{i}",
                        replication::quote_identifier(c)
                    )
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        RowReader {
            id_column: replication::quote_identifier(config.mapping.column(outbox::Role::Id)),
            id_kind: columns.id_kind(),
            builder: EventBuilder::shaped(
                columns.clone(),
                config.shape(),
                config.mapping.filter.clone(),
            ),
            select,
        }
    }

    /// The select list: the read columns, each as text, in the builder's order.
    pub fn select(&self) -> &str {
        &self.select
    }

    /// The id column, quoted.
    pub fn id_column(&self) -> &str {
        &self.id_column
    }

    /// The id column's kind.
    pub fn id_kind(&self) -> IdKind {
        self.id_kind
    }

    /// The id column as compared and ordered (ROW2): text ids by their bytes.
    pub fn id_ordered(&self) -> String {
        match self.id_kind {
            IdKind::Text => format!("{} COLLATE \"C\"", self.id_column),
            IdKind::Integer | IdKind::Uuid => self.id_column.clone(),
        }
    }

    /// `ORDER BY`'s expression for id order (ROW2).
    pub fn order_by(&self) -> String {
        self.id_ordered()
    }

    /// An SQL expression of the id `text` as the column's type, to compare with
    /// [`Self::id_ordered`]: a literal (quoted), cast.
    pub fn id_literal(&self, text: &str) -> String {
        let literal = replication::quote_literal(text);
        match self.id_kind {
            IdKind::Integer => format!("{literal}::int8"),
            IdKind::Uuid => format!("{literal}::uuid"),
            // Parenthesised: `BETWEEN` takes no `COLLATE` clause bare.
            IdKind::Text => format!("({literal}::text COLLATE \"C\")"),
        }
    }

    /// The id of a row this reader selected (its first column), when it can be read.
    pub fn id_of(&self, row: &tokio_postgres::Row) -> Option<EventId> {
        let text: Option<String> = row.try_get(0).ok().flatten();
        EventId::parse(self.id_kind, &text?)
    }

    /// The event of a row this reader selected, at `position`; `None` when the filter
    /// excludes its event type.
    pub fn event(
        &self,
        row: &tokio_postgres::Row,
        position: Position,
    ) -> std::result::Result<Option<OutboxEvent>, outbox::EventError> {
        self.builder.build_values(
            |i| {
                Ok(row
                    .try_get::<_, Option<String>>(i)
                    .ok()
                    .flatten()
                    .map(Bytes::from))
            },
            position,
        )
    }
}

/// An argument error (exit 2) unless `text` is an id of `kind`: an integer (`bigint`), a
/// uuid Postgres reads, or any text.
pub async fn check_id_bound(
    client: &tokio_postgres::Client,
    kind: IdKind,
    flag: &str,
    text: &str,
) -> Result<()> {
    let valid = match kind {
        IdKind::Integer => text.parse::<i64>().is_ok(),
        IdKind::Uuid => client
            .query_one("SELECT $1::text::uuid", &[&text])
            .await
            .is_ok(),
        IdKind::Text => true,
    };
    if valid {
        Ok(())
    } else {
        Err(RelayError::setup(anyhow::anyhow!(
            "{flag} {text:?} is not an id of the outbox table's id column ({})",
            kind.sql_type()
        )))
    }
}

/// The SQL condition `{id column} = ANY($1::text[]::{its type}[])`: `$1` a `text[]` of ids of
/// any kind, cast to the column's own type so the primary key's index serves it; the type
/// read from the catalog on `client` (marking and retention, whatever the mapping).
pub async fn id_in_text_array(client: &Client, config: &Config) -> anyhow::Result<String> {
    let id = config.mapping.column(outbox::Role::Id);
    let row = client
        .query_opt(
            "SELECT pg_catalog.format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a \
              WHERE a.attrelid = $1::text::regclass AND a.attname = $2 AND a.attnum > 0 AND NOT a.attisdropped",
            &[&config.table.sql(), &id],
        )
        .await?
        .ok_or_else(|| anyhow::anyhow!("table {} has no column {id}", config.table))?;
    let type_name: String = row.get(0);
    Ok(format!(
        "{} = ANY($1::text[]::{type_name}[])",
        replication::quote_identifier(id)
    ))
}

/// A reader for a table of the seed's column names whose id column has type `id_type`
/// (any other than an integer under a mapping that is not the seed's), for unit tests.
#[cfg(test)]
pub(crate) fn test_reader(config: &Config, id_type: u32) -> RowReader {
    use outbox::event::oid;
    // The seed's table keeps integer ids: any other id needs a mapping.
    let mut mapping = config.mapping.clone();
    mapping.filter.exclude = vec!["Noise".into()];
    let columns = outbox::OutboxColumns::resolve_mapped(
        "public.t",
        &mapping,
        [
            ("id", id_type),
            ("entity_id", oid::TEXT),
            ("event_type", oid::TEXT),
            ("payload", oid::JSONB),
            ("created_at", oid::TIMESTAMPTZ),
        ],
    )
    .unwrap();
    RowReader::with_payload(config, columns)
}
