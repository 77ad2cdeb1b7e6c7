//! The user's outbox table: which column is which, the types they may have, the extra
//! columns copied into headers, the subject template and the event-type filter.
//!
//! The seed's `outbox_events` (`sql/schema.sql`) is the default ([`Mapping::default`]), and
//! under it every key, subject and header is byte-identical to what the relay always
//! published. Everything else is opt-in: [`Preset::Debezium`] for the table of Debezium's
//! outbox router (and of its Quarkus extension), or columns named one by one.
//!
//! # Invariants
//! - MAP1 A mapping names five distinct columns (id, entity id, event type, payload,
//!   creation time); an extra header's column may repeat one of them, its header name is
//!   a valid header name that no relay header (`Nats-*`, `Outbox-*`) can be.
//! - MAP2 The id's kind is the column's type (integer, uuid, text): integer ids keep the
//!   seed's keys exactly; the others keep the seed's `dedupe_key` formula and an ordering
//!   key `{created_at_ms:013}:{id}` ([`crate::keys::compute_keys_for`]).
//! - MAP3 [`Mapping::fingerprint`] is a function of everything that shapes a message (not
//!   of where the table lives): two mappings publish the same message for the same row
//!   exactly when their fingerprints are equal. The default mapping's is `""`.
//! - MAP4 An event type is published exactly when [`EventTypeFilter::admits`] it: a
//!   non-empty include list admits only its members, the exclude list never admits its own.

use std::fmt;

use crate::template::SubjectTemplate;

/// Type OIDs the relay understands (`pg_type.oid`; stable across Postgres versions).
pub mod oid {
    /// `smallint`.
    pub const INT2: u32 = 21;
    /// `integer`.
    pub const INT4: u32 = 23;
    /// `bigint`.
    pub const INT8: u32 = 20;
    /// `text`.
    pub const TEXT: u32 = 25;
    /// `character varying`.
    pub const VARCHAR: u32 = 1043;
    /// `name`.
    pub const NAME: u32 = 19;
    /// `uuid`.
    pub const UUID: u32 = 2950;
    /// `json`.
    pub const JSON: u32 = 114;
    /// `jsonb`.
    pub const JSONB: u32 = 3802;
    /// `timestamp with time zone`.
    pub const TIMESTAMPTZ: u32 = 1184;
    /// `timestamp` (without time zone).
    pub const TIMESTAMP: u32 = 1114;
    /// `bytea`.
    pub const BYTEA: u32 = 17;

    /// A readable name for the types above.
    pub fn name(oid: u32) -> String {
        match oid {
            INT2 => "smallint".into(),
            INT4 => "integer".into(),
            INT8 => "bigint".into(),
            TEXT => "text".into(),
            VARCHAR => "varchar".into(),
            NAME => "name".into(),
            UUID => "uuid".into(),
            JSON => "json".into(),
            JSONB => "jsonb".into(),
            TIMESTAMPTZ => "timestamptz".into(),
            TIMESTAMP => "timestamp (without time zone)".into(),
            BYTEA => "bytea".into(),
            1042 => "char(n)".into(),
            other => format!("type oid {other}"),
        }
    }
}

/// What an id column holds (MAP2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdKind {
    /// `smallint`, `integer`, `bigint`: the seed's ids.
    Integer,
    /// `uuid`, as Postgres prints it (lower-case, hyphenated).
    Uuid,
    /// `text` or `varchar`, exactly.
    Text,
}

impl IdKind {
    /// The kind of a column of type `type_oid`, if it can be an id.
    pub fn of(type_oid: u32) -> Option<IdKind> {
        match type_oid {
            oid::INT8 | oid::INT4 | oid::INT2 => Some(IdKind::Integer),
            oid::UUID => Some(IdKind::Uuid),
            oid::TEXT | oid::VARCHAR => Some(IdKind::Text),
            _ => None,
        }
    }

    /// The `Outbox-Id-Kind` header's value; `None` for integers (the seed's messages carry
    /// no such header).
    pub fn header_value(self) -> Option<&'static str> {
        match self {
            IdKind::Integer => None,
            IdKind::Uuid => Some("uuid"),
            IdKind::Text => Some("text"),
        }
    }

    /// Inverts [`Self::header_value`] (absent: integer).
    pub fn from_header(value: Option<&str>) -> Option<IdKind> {
        match value {
            None => Some(IdKind::Integer),
            Some("uuid") => Some(IdKind::Uuid),
            Some("text") => Some(IdKind::Text),
            Some(_) => None,
        }
    }

    /// The SQL type a text parameter is cast to when compared with the column.
    pub fn sql_type(self) -> &'static str {
        match self {
            IdKind::Integer => "bigint",
            IdKind::Uuid => "uuid",
            IdKind::Text => "text",
        }
    }
}

/// What a payload column holds: the message body is its text, or its bytes (`bytea`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// `jsonb`, `json`, `text`, `varchar`: the text exactly as Postgres prints it.
    Text,
    /// `bytea`: the bytes as stored.
    Bytes,
}

impl PayloadKind {
    /// The kind of a column of type `type_oid`, if it can be a payload.
    pub fn of(type_oid: u32) -> Option<PayloadKind> {
        match type_oid {
            oid::JSONB | oid::JSON | oid::TEXT | oid::VARCHAR => Some(PayloadKind::Text),
            oid::BYTEA => Some(PayloadKind::Bytes),
            _ => None,
        }
    }
}

/// What a creation-time column holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TimeKind {
    /// `timestamptz`.
    WithZone,
    /// `timestamp` without time zone, read as UTC (Debezium's Quarkus extension writes
    /// `Instant`s into one).
    Utc,
}

impl TimeKind {
    /// The kind of a column of type `type_oid`, if it can be a creation time.
    pub fn of(type_oid: u32) -> Option<TimeKind> {
        match type_oid {
            oid::TIMESTAMPTZ => Some(TimeKind::WithZone),
            oid::TIMESTAMP => Some(TimeKind::Utc),
            _ => None,
        }
    }
}

/// The roles of a table's columns, in [`Mapping::roles`] order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The event id.
    Id,
    /// The entity (aggregate) id: the partition key.
    EntityId,
    /// The event type.
    EventType,
    /// The message body.
    Payload,
    /// The creation time: the ordering key's first part.
    CreatedAt,
}

impl Role {
    /// The five roles.
    pub const ALL: [Role; 5] = [
        Role::Id,
        Role::EntityId,
        Role::EventType,
        Role::Payload,
        Role::CreatedAt,
    ];

    /// The seed's column for the role, and the setting that names another.
    pub fn seed_column(self) -> &'static str {
        match self {
            Role::Id => "id",
            Role::EntityId => "entity_id",
            Role::EventType => "event_type",
            Role::Payload => "payload",
            Role::CreatedAt => "created_at",
        }
    }

    /// The types a column in this role may have, for error messages.
    pub fn accepted(self) -> &'static str {
        match self {
            Role::Id => "bigint, integer, smallint, uuid or text",
            Role::EntityId => "text, varchar or uuid",
            Role::EventType => "text or varchar",
            Role::Payload => "jsonb, json, text or bytea",
            Role::CreatedAt => "timestamptz (or timestamp, read as UTC)",
        }
    }

    /// Whether a column of type `type_oid` can play this role.
    pub fn accepts(self, type_oid: u32) -> bool {
        match self {
            Role::Id => IdKind::of(type_oid).is_some(),
            Role::EntityId => {
                matches!(type_oid, oid::TEXT | oid::VARCHAR | oid::NAME | oid::UUID)
            }
            Role::EventType => matches!(type_oid, oid::TEXT | oid::VARCHAR | oid::NAME),
            Role::Payload => PayloadKind::of(type_oid).is_some(),
            Role::CreatedAt => TimeKind::of(type_oid).is_some(),
        }
    }
}

/// A column copied into a header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HeaderColumn {
    /// The column.
    pub column: String,
    /// The header's name.
    pub header: String,
}

/// Named mappings for tables other tools made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// The seed's `outbox_events` (`sql/schema.sql`).
    Seed,
    /// Debezium's documented outbox table (`id uuid`, `aggregatetype`, `aggregateid`,
    /// `type`, `payload`), with the `timestamp` column of its Quarkus extension as the
    /// creation time and its `tracingspancontext` column, when the table has one, as the
    /// trace context; subjects `{prefix}.{aggregatetype}.{shard}`, as its router routes by
    /// aggregate type.
    Debezium,
}

impl Preset {
    /// `seed` or `debezium`.
    pub fn parse(v: &str) -> Result<Preset, String> {
        match v {
            "seed" => Ok(Preset::Seed),
            "debezium" => Ok(Preset::Debezium),
            _ => Err("expected seed (sql/schema.sql's outbox_events) or debezium (Debezium's outbox table: id, aggregatetype, aggregateid, type, timestamp, payload, tracingspancontext)".into()),
        }
    }

    /// The preset's mapping.
    pub fn mapping(self) -> Mapping {
        match self {
            Preset::Seed => Mapping::default(),
            Preset::Debezium => Mapping {
                columns: [
                    "id".into(),
                    "aggregateid".into(),
                    "type".into(),
                    "payload".into(),
                    "timestamp".into(),
                ],
                trace_context: Some(TraceContext {
                    column: "tracingspancontext".into(),
                    required: false,
                }),
                template: SubjectTemplate::parse("{prefix}.{aggregatetype}.{shard}")
                    .expect("the preset's template is valid"),
                ..Mapping::default()
            },
        }
    }
}

/// A column holding the producer's W3C trace context.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The column.
    pub column: String,
    /// Whether the table must have it (a preset's is used only when present).
    pub required: bool,
}

/// Which event types are published (MAP4).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct EventTypeFilter {
    /// When non-empty, only these.
    pub include: Vec<String>,
    /// Never these.
    pub exclude: Vec<String>,
}

impl EventTypeFilter {
    /// Whether events of `event_type` are published (MAP4).
    pub fn admits(&self, event_type: &str) -> bool {
        (self.include.is_empty() || self.include.iter().any(|t| t == event_type))
            && !self.exclude.iter().any(|t| t == event_type)
    }

    /// Whether every event type is published.
    pub fn admits_all(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }
}

/// How the relay reads the user's table and shapes its messages.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mapping {
    /// The columns of the five roles, in [`Role::ALL`] order.
    pub columns: [String; 5],
    /// Columns copied into headers.
    pub headers: Vec<HeaderColumn>,
    /// The column holding a W3C trace context (`traceparent`, or Debezium's
    /// `tracingspancontext` properties), published as `traceparent` and `tracestate`.
    pub trace_context: Option<TraceContext>,
    /// The subject of each event.
    pub template: SubjectTemplate,
    /// Which event types are published.
    pub filter: EventTypeFilter,
}

impl Default for Mapping {
    fn default() -> Self {
        Mapping {
            columns: Role::ALL.map(|r| r.seed_column().to_owned()),
            headers: Vec::new(),
            trace_context: None,
            template: SubjectTemplate::default(),
            filter: EventTypeFilter::default(),
        }
    }
}

impl Mapping {
    /// The column playing `role`.
    pub fn column(&self, role: Role) -> &str {
        &self.columns[role as usize]
    }

    /// Whether this is the seed's table under the default settings.
    pub fn is_default(&self) -> bool {
        *self == Mapping::default()
    }

    /// Every column the relay reads, each once, in a stable order: the roles', the
    /// template's, the headers', the trace context's.
    pub fn read_columns(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        let all = self
            .columns
            .iter()
            .map(String::as_str)
            .chain(self.template.columns())
            .chain(self.headers.iter().map(|h| h.column.as_str()))
            .chain(self.trace_context.iter().map(|t| t.column.as_str()));
        for column in all {
            if !out.contains(&column) {
                out.push(column);
            }
        }
        out
    }

    /// Checks MAP1.
    pub fn validate(&self) -> Result<(), String> {
        for (i, a) in self.columns.iter().enumerate() {
            if a.is_empty() {
                return Err(format!(
                    "the {} column's name is empty",
                    Role::ALL[i].seed_column()
                ));
            }
            if let Some(j) = self.columns[..i].iter().position(|b| b == a) {
                return Err(format!(
                    "column {a} is mapped both as the {} and as the {}: each role needs its own column",
                    Role::ALL[j].seed_column(),
                    Role::ALL[i].seed_column()
                ));
            }
        }
        let mut names: Vec<String> = Vec::new();
        for h in &self.headers {
            validate_header_name(&h.header)?;
            let lower = h.header.to_ascii_lowercase();
            if names.contains(&lower) || (self.trace_context.is_some() && is_trace_header(&lower)) {
                return Err(format!("header {} is given twice", h.header));
            }
            names.push(lower);
        }
        Ok(())
    }

    /// MAP3: the settings that shape messages, as one line; `""` for the default mapping.
    pub fn fingerprint(&self) -> String {
        if self.is_default() {
            return String::new();
        }
        let mut out = String::new();
        for (role, column) in Role::ALL.iter().zip(&self.columns) {
            out.push_str(&format!("{}={column};", role.seed_column()));
        }
        if !self.headers.is_empty() {
            let list: Vec<String> = self
                .headers
                .iter()
                .map(|h| format!("{}:{}", h.column, h.header))
                .collect();
            out.push_str(&format!("headers={};", list.join(",")));
        }
        if let Some(t) = &self.trace_context {
            out.push_str(&format!("trace_context={};", t.column));
        }
        out.push_str(&format!("subject={};", self.template));
        if !self.filter.include.is_empty() {
            out.push_str(&format!("include={};", self.filter.include.join(",")));
        }
        if !self.filter.exclude.is_empty() {
            out.push_str(&format!("exclude={};", self.filter.exclude.join(",")));
        }
        out
    }
}

impl fmt::Display for Mapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_default() {
            f.write_str("the seed's columns")
        } else {
            f.write_str(self.fingerprint().trim_end_matches(';'))
        }
    }
}

fn is_trace_header(lower: &str) -> bool {
    lower == TRACEPARENT || lower == TRACESTATE
}

/// The W3C trace context's header names, as OpenTelemetry's propagators write them.
pub const TRACEPARENT: &str = "traceparent";
/// See [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// A header name the user may choose: an RFC 7230 token that is not one of the relay's
/// (`Nats-*`, `Outbox-*`).
pub fn validate_header_name(name: &str) -> Result<(), String> {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || !name.bytes().all(tchar) {
        return Err(format!(
            "header name {name:?} is not a header token (letters, digits and !#$%&'*+-.^_`|~)"
        ));
    }
    let lower = name.to_ascii_lowercase();
    if lower.starts_with("nats-") || lower.starts_with("outbox-") {
        return Err(format!(
            "header name {name} is reserved: Nats-* and Outbox-* headers are the server's and the relay's"
        ));
    }
    Ok(())
}

/// Parses `column[:Header-Name],...` (the header defaults to the column's name).
pub fn parse_header_columns(v: &str) -> Result<Vec<HeaderColumn>, String> {
    let mut out = Vec::new();
    for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (column, header) = item.split_once(':').unwrap_or((item, item));
        let (column, header) = (column.trim(), header.trim());
        if column.is_empty() {
            return Err(format!(
                "{item:?} names no column (expected column or column:Header-Name)"
            ));
        }
        validate_header_name(header)?;
        out.push(HeaderColumn {
            column: column.to_owned(),
            header: header.to_owned(),
        });
    }
    Ok(out)
}

/// Parses a comma-separated list of event types (each trimmed; empty items dropped).
pub fn parse_event_types(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The `traceparent` and `tracestate` a trace-context column's value carries: a bare
/// `traceparent` value (`00-{trace id}-{span id}-{flags}`), or Java properties text as
/// Debezium's `tracingspancontext` holds it (`traceparent` and `tracestate` keys, read as
/// `java.util.Properties.load` reads them: [`crate::properties`], so `tracestate`'s escaped
/// `\=` arrive as `=`). `None` when the value holds no well-formed traceparent (the event is
/// then published without one: a trace context is advisory, never a reason to stop).
pub fn trace_context(value: &str) -> Option<(String, Option<String>)> {
    let value = value.trim();
    if is_traceparent(value) {
        return Some((value.to_owned(), None));
    }
    let pairs = crate::properties::parse(value);
    let last = |key: &str| {
        pairs
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.trim().to_owned())
    };
    let state = last(TRACESTATE).filter(|s| !s.is_empty());
    last(TRACEPARENT)
        .filter(|p| is_traceparent(p))
        .map(|p| (p, state))
}

/// `{2 hex version}-{32 hex trace id}-{16 hex span id}-{2 hex flags}`, lower-case, ids not
/// all zero (W3C Trace Context, version 00 and its successors' prefix).
pub fn is_traceparent(v: &str) -> bool {
    let parts: Vec<&str> = v.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    parts.len() >= 4
        && hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && parts[1].bytes().any(|b| b != b'0')
        && parts[2].bytes().any(|b| b != b'0')
        && (parts[0] != "00" || parts.len() == 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_mapping_is_the_seeds_and_has_an_empty_fingerprint() {
        let m = Mapping::default();
        assert!(m.is_default());
        assert_eq!(m.fingerprint(), "");
        assert_eq!(
            m.read_columns(),
            ["id", "entity_id", "event_type", "payload", "created_at"]
        );
        assert_eq!(Preset::Seed.mapping(), m);
    }

    #[test]
    fn debeziums_preset_reads_its_columns() {
        let m = Preset::Debezium.mapping();
        assert_eq!(m.column(Role::EntityId), "aggregateid");
        assert_eq!(m.column(Role::EventType), "type");
        assert_eq!(m.column(Role::CreatedAt), "timestamp");
        assert_eq!(
            m.read_columns(),
            [
                "id",
                "aggregateid",
                "type",
                "payload",
                "timestamp",
                "aggregatetype",
                "tracingspancontext"
            ]
        );
        assert_eq!(
            m.fingerprint(),
            "id=id;entity_id=aggregateid;event_type=type;payload=payload;created_at=timestamp;\
             trace_context=tracingspancontext;subject={prefix}.{aggregatetype}.{shard};"
        );
        m.validate().unwrap();
    }

    #[test]
    fn header_columns_parse_and_reserved_names_are_refused() {
        let h = parse_header_columns("tenant, region:X-Region ,").unwrap();
        assert_eq!(
            h[0],
            HeaderColumn {
                column: "tenant".into(),
                header: "tenant".into()
            }
        );
        assert_eq!(h[1].header, "X-Region");
        for bad in ["a:Nats-Msg-Id", "a:outbox-id", "a:two words", ":x"] {
            assert!(parse_header_columns(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_column_in_two_roles_is_refused() {
        let mut m = Mapping::default();
        m.columns[1] = "id".into();
        let e = m.validate().unwrap_err();
        assert!(
            e.contains("column id is mapped both as the id and as the entity_id"),
            "{e}"
        );
    }

    #[test]
    fn the_filter_admits_what_it_should() {
        let f = EventTypeFilter {
            include: vec![],
            exclude: vec!["Noise".into()],
        };
        assert!(f.admits("OrderPaid") && !f.admits("Noise"));
        let f = EventTypeFilter {
            include: vec!["A".into(), "B".into()],
            exclude: vec!["B".into()],
        };
        assert!(f.admits("A") && !f.admits("B") && !f.admits("C"));
        assert!(EventTypeFilter::default().admits_all());
    }

    #[test]
    fn trace_context_from_a_traceparent_or_debeziums_properties() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert_eq!(trace_context(tp), Some((tp.into(), None)));
        // As Java's Properties.store writes it (tests/java_properties.rs reads files Java wrote).
        let props = format!(
            "#Mon Jan 01 00:00:00 UTC 2024\ntracestate=congo\\=t61rcWkgMzE,rojo\\=00f067aa0ba902b7\ntraceparent={tp}\n"
        );
        assert_eq!(
            trace_context(&props),
            Some((
                tp.into(),
                Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7".into())
            ))
        );
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "traceparent=00-XYZ",
        ] {
            assert_eq!(trace_context(bad), None, "{bad}");
        }
    }
}
