//! The options table: every option's file key, flag, environment variable, default and help
//! ([`OptionSpec`], [`opt`]), and the `nats` CLI's variables the relay also reads.

use super::*;

/// One option: its file key, flag, environment variable and default.
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    /// Key in the TOML file.
    pub key: &'static str,
    /// Environment variable.
    pub env: &'static str,
    /// Default, if any.
    pub default: Option<&'static str>,
    /// What the option does (shown by `--help`).
    pub help: &'static str,
    /// The flag's name when it is not the key with dashes (the `nats` CLI's names).
    pub long: Option<&'static str>,
}

impl OptionSpec {
    /// The flag's name without the dashes: `long`, or the key with dashes.
    pub fn long(&self) -> String {
        self.long
            .map_or_else(|| self.key.replace('_', "-"), str::to_owned)
    }

    /// The command-line flag, `--key-with-dashes` (or `--{long}`).
    pub fn flag(&self) -> String {
        format!("--{}", self.long())
    }

    /// How to set it: `--flag, ENV or the file key key`.
    pub fn how_to_set(&self) -> String {
        format!("{}, {} or the file key {}", self.flag(), self.env, self.key)
    }

    /// Whether it is a yes/no option (those default to `false`): given as a bare flag
    /// (`--mark-published`) it means `true`.
    pub fn is_switch(&self) -> bool {
        self.default == Some("false")
    }

    /// Whether its value is (or may hold) a secret, never to be shown (CFG1).
    pub fn is_secret(&self) -> bool {
        key_is_secret(self.key)
    }
}

macro_rules! long {
    () => {
        None
    };
    ($flag:literal) => {
        Some($flag)
    };
}

macro_rules! options {
    ($($name:ident = ($key:literal, $env:literal, $default:expr, $help:literal $(, flag = $flag:literal)?);)*) => {
        $(
            #[doc = $help]
            pub const $name: OptionSpec = OptionSpec { key: $key, env: $env, default: $default, help: $help, long: long!($($flag)?) };
        )*
        /// Every option, in help order.
        pub const ALL: &[OptionSpec] = &[$($name),*];
    };
}

/// The options.
pub mod opt {
    use super::OptionSpec;
    options! {
        DATABASE_URL = ("database_url", "DATABASE_URL", None,
            "Postgres connection: a libpq URL (postgres://user:pass@host:port/db?sslmode=verify-full) or key=value string; the PG* variables and ~/.pgpass fill in what it omits, and may replace it");
        PRIMARY_URL = ("primary_url", "OUTBOX_RELAY_PRIMARY_URL", None,
            "Decode on a standby (PostgreSQL 16+): DATABASE_URL names the standby, this libpq URL the primary, for what must be written there (the publication, heartbeats, marking); list every node with target_session_attrs=read-write to follow a promotion");
        NATS_URL = ("nats_url", "NATS_URL", Some("nats://127.0.0.1:4222"),
            "NATS server URL(s), comma-separated: nats:// or tls:// (the relay speaks the NATS TCP protocol, not ws://); user:password@ or token@ in a URL authenticates (percent-encoded, a ',' as %2C)");
        // NATS authentication and TLS: the `nats` CLI's flag names (crate::config::nats).
        NATS_USER = ("nats_user", "OUTBOX_RELAY_NATS_USER", None,
            "NATS user name (with --password)", flag = "user");
        NATS_PASSWORD = ("nats_password", "OUTBOX_RELAY_NATS_PASSWORD", None,
            "NATS password (with --user)", flag = "password");
        NATS_TOKEN = ("nats_token", "OUTBOX_RELAY_NATS_TOKEN", None,
            "NATS authentication token", flag = "token");
        NATS_NKEY = ("nats_nkey", "OUTBOX_RELAY_NATS_NKEY", None,
            "File holding the NATS user's nkey seed (SU...)", flag = "nkey");
        NATS_CREDS = ("nats_creds", "OUTBOX_RELAY_NATS_CREDS", None,
            "NATS credentials file (.creds: user JWT and nkey seed)", flag = "creds");
        NATS_TLSCA = ("nats_tlsca", "OUTBOX_RELAY_NATS_TLSCA", None,
            "PEM file of the CA(s) that sign the NATS server's certificate (implies TLS; default: the system's roots)", flag = "tlsca");
        NATS_TLSCERT = ("nats_tlscert", "OUTBOX_RELAY_NATS_TLSCERT", None,
            "PEM client certificate (chain) for NATS, with --tlskey (implies TLS)", flag = "tlscert");
        NATS_TLSKEY = ("nats_tlskey", "OUTBOX_RELAY_NATS_TLSKEY", None,
            "PEM private key of --tlscert", flag = "tlskey");
        NATS_TLSFIRST = ("nats_tlsfirst", "OUTBOX_RELAY_NATS_TLSFIRST", Some("false"),
            "TLS handshake before the server's INFO, for servers configured with handshake_first (implies TLS)", flag = "tlsfirst");
        NATS_NO_RANDOMIZE = ("nats_no_randomize", "OUTBOX_RELAY_NATS_NO_RANDOMIZE", Some("false"),
            "Dial the NATS servers in the order given (and those the cluster advertises after them) instead of a random order per connection", flag = "no-randomize");
        NATS_INBOX_PREFIX = ("nats_inbox_prefix", "OUTBOX_RELAY_NATS_INBOX_PREFIX", Some("_INBOX"),
            "Subject prefix of the replies the relay subscribes to (its publish acks and requests' replies): the NATS user needs subscribe on {prefix}.> only", flag = "inbox-prefix");
        TABLE = ("table", "OUTBOX_RELAY_TABLE", Some("public.outbox_events"),
            "The outbox table, as SQL writes it: schema.table, or table in schema public; an unquoted name is folded to lower case, one in double quotes keeps its case, spaces and dots");
        // The user's own table (crate::config::table; docs/own-table.md).
        TABLE_PRESET = ("table_preset", "OUTBOX_RELAY_TABLE_PRESET", Some("seed"),
            "The outbox table's shape: seed (sql/schema.sql's id, entity_id, event_type, payload, created_at) or debezium (id uuid, aggregatetype, aggregateid, type, timestamp, payload, and tracingspancontext when present; subjects {prefix}.{aggregatetype}.{shard}); the *_column settings override single columns");
        ID_COLUMN = ("id_column", "OUTBOX_RELAY_ID_COLUMN", None,
            "The event id column (bigint, integer, uuid or text); default: the preset's");
        ENTITY_ID_COLUMN = ("entity_id_column", "OUTBOX_RELAY_ENTITY_ID_COLUMN", None,
            "The entity (aggregate) id column, the partition key (text, varchar or uuid); default: the preset's");
        EVENT_TYPE_COLUMN = ("event_type_column", "OUTBOX_RELAY_EVENT_TYPE_COLUMN", None,
            "The event type column (text or varchar); default: the preset's");
        PAYLOAD_COLUMN = ("payload_column", "OUTBOX_RELAY_PAYLOAD_COLUMN", None,
            "The payload column (jsonb, json, text, or bytea published as its bytes); default: the preset's");
        CREATED_AT_COLUMN = ("created_at_column", "OUTBOX_RELAY_CREATED_AT_COLUMN", None,
            "The creation time column (timestamptz, or timestamp read as UTC), the ordering key's first part; default: the preset's");
        HEADER_COLUMNS = ("header_columns", "OUTBOX_RELAY_HEADER_COLUMNS", None,
            "Columns copied into headers: column[:Header-Name], comma-separated (a NULL gives no header; names may not start with Nats- or Outbox-)");
        TRACE_CONTEXT_COLUMN = ("trace_context_column", "OUTBOX_RELAY_TRACE_CONTEXT_COLUMN", None,
            "A column holding the producer's W3C trace context (a traceparent value, or Debezium's tracingspancontext properties), published as the traceparent and tracestate headers");
        SUBJECT_TEMPLATE = ("subject_template", "OUTBOX_RELAY_SUBJECT_TEMPLATE", None,
            "Subjects of events: {prefix} first, {shard} once, and {event_type} or {column} placeholders as whole tokens, e.g. {prefix}.{aggregatetype}.{shard}; default: the preset's ({prefix}.{shard}.{event_type} for seed)");
        INCLUDE_EVENT_TYPES = ("include_event_types", "OUTBOX_RELAY_INCLUDE_EVENT_TYPES", None,
            "Publish only events of these types (comma-separated); the others are confirmed without publishing and counted");
        EXCLUDE_EVENT_TYPES = ("exclude_event_types", "OUTBOX_RELAY_EXCLUDE_EVENT_TYPES", None,
            "Never publish events of these types (comma-separated): confirmed without publishing and counted");
        SLOT = ("slot", "OUTBOX_RELAY_SLOT", Some("outbox_relay"),
            "Logical replication slot (pgoutput)");
        PUBLICATION = ("publication", "OUTBOX_RELAY_PUBLICATION", Some("outbox_relay"),
            "Publication of the outbox table's inserts");
        STREAM = ("stream", "OUTBOX_RELAY_STREAM", Some("OUTBOX"),
            "JetStream stream");
        SUBJECT_PREFIX = ("subject_prefix", "OUTBOX_RELAY_SUBJECT_PREFIX", Some("outbox"),
            "Subjects are {prefix}.{shard}.{event_type}");
        PARTITIONS = ("partitions", "OUTBOX_RELAY_PARTITIONS", Some("12"),
            "Shard count: shard = sha256(entity_id)[..8] as u64 mod partitions");
        MAX_IN_FLIGHT = ("max_in_flight", "OUTBOX_RELAY_MAX_IN_FLIGHT", Some("4096"),
            "Publishes awaiting a JetStream ack at most");
        DUPLICATE_WINDOW = ("duplicate_window", "OUTBOX_RELAY_DUPLICATE_WINDOW", Some("2m"),
            "Duplicate window of a stream the relay creates (e.g. 120s, 2m, 1h)");
        // The stream the relay creates (policy::stream); an existing one is checked against
        // the ones given explicitly.
        STREAM_REPLICAS = ("stream_replicas", "OUTBOX_RELAY_STREAM_REPLICAS", Some("1"),
            "Replicas of a stream the relay creates, 1 to 5 (more than 1 needs a JetStream cluster)");
        STREAM_STORAGE = ("stream_storage", "OUTBOX_RELAY_STREAM_STORAGE", Some("file"),
            "Storage of a stream the relay creates: file, or memory (a nats-server restart loses every event it holds, though Postgres has released them: the relay warns)");
        STREAM_MAX_AGE = ("stream_max_age", "OUTBOX_RELAY_STREAM_MAX_AGE", Some("unlimited"),
            "A stream the relay creates deletes events older than this (e.g. 7d, 12h), or unlimited; a limit warns that events no consumer has read yet can be lost");
        STREAM_MAX_BYTES = ("stream_max_bytes", "OUTBOX_RELAY_STREAM_MAX_BYTES", Some("unlimited"),
            "Size limit of a stream the relay creates (e.g. 10GiB; K, M, G, T are powers of 1024), or unlimited; what happens at the limit is --stream-discard");
        STREAM_MAX_MSG_SIZE = ("stream_max_msg_size", "OUTBOX_RELAY_STREAM_MAX_MSG_SIZE", Some("unlimited"),
            "Largest message a stream the relay creates accepts (e.g. 1MiB), or unlimited; the server's max_payload caps it anyway, and larger events are poison (--on-poison)");
        STREAM_DISCARD = ("stream_discard", "OUTBOX_RELAY_STREAM_DISCARD", Some("old"),
            "What a stream the relay creates does at its size limit: old (deletes its oldest events, read or not) or new (refuses new events: the relay's publishes fail and it retries until room is made)");
        ACK_TIMEOUT = ("ack_timeout", "OUTBOX_RELAY_ACK_TIMEOUT", Some("10s"),
            "How long to wait for a JetStream ack before reconnecting");
        SHUTDOWN_TIMEOUT = ("shutdown_timeout", "OUTBOX_RELAY_SHUTDOWN_TIMEOUT", Some("10s"),
            "On SIGTERM/SIGINT, how long to wait for in-flight acks");
        SHARED_STREAM = ("shared_stream", "OUTBOX_RELAY_SHARED_STREAM", Some("false"),
            "Other writers publish to the stream too: de-duplication only, no sequence fencing or tail resume (weaker; see docs/guarantees.md)");
        ON_POISON = ("on_poison", "OUTBOX_RELAY_ON_POISON", Some("halt"),
            "An event JetStream can never accept: halt (stop, naming it) or dead-letter (a record on {prefix}.dlq in its place)");
        ATOMIC_TRANSACTIONS = ("atomic_transactions", "OUTBOX_RELAY_ATOMIC_TRANSACTIONS", Some("false"),
            "Publish each Postgres transaction as one JetStream atomic batch (nats-server 2.12 or newer, a stream with allow_atomic: set on streams the relay creates): consumers never see part of a transaction; one larger than the server's batch limit (1000) is split at it. Strict mode only");
        FAST_INGEST = ("fast_ingest", "OUTBOX_RELAY_FAST_INGEST", Some("true"),
            "Publish consecutive events as fast-ingest batches where the server and the stream allow it (nats-server 2.14 or newer, a one-replica stream with allow_batched: set on streams the relay creates): one answer per batch instead of one per event; elsewhere, in shared mode and with --atomic-transactions, one acknowledged publish per event; false: always one per event");
        CLOUDEVENTS = ("cloudevents", "OUTBOX_RELAY_CLOUDEVENTS", Some("false"),
            "Also publish each event's CloudEvents 1.0 attributes as headers (binary content mode: ce-id is the dedupe key, ce-type the event type, ce-subject the entity id, ce-time created_at; docs/consumers.md)");
        CLOUDEVENTS_SOURCE = ("cloudevents_source", "OUTBOX_RELAY_CLOUDEVENTS_SOURCE", None,
            "The ce-source of every event with --cloudevents, a URI-reference; default: /{database}/{schema}/{table}");
        WORKER_THREADS = ("worker_threads", "OUTBOX_RELAY_WORKER_THREADS", Some("1"),
            "Runtime threads: 1 runs everything on one thread (fastest where Postgres and NATS share the cores); more spreads the relay's tasks");
        MAX_LAG_BYTES = ("max_lag_bytes", "OUTBOX_RELAY_MAX_LAG_BYTES", Some("1GiB"),
            "Slot lag (WAL the slot retains past its confirmed position) above which outbox-relay status reports lagging and /readyz answers stalled (e.g. 512MiB)");
        // Operations: heartbeats for a quiet outbox database (crate::process::heartbeat) and PG 17
        // fail-over slots (crate::postgres::checks::ensure_slot).
        HEARTBEAT_INTERVAL = ("heartbeat_interval", "OUTBOX_RELAY_HEARTBEAT_INTERVAL", Some("off"),
            "While streaming, write a tiny WAL message (pg_logical_emit_message) in the outbox database this often (e.g. 30s), or off: lets the slot advance when only other databases of the cluster write");
        FAILOVER_SLOT = ("failover_slot", "OUTBOX_RELAY_FAILOVER_SLOT", Some("false"),
            "Create the slot with failover = true (Postgres 17 or newer), so a standby with sync_replication_slots keeps it across a fail-over");
        LOG_FORMAT = ("log_format", "OUTBOX_RELAY_LOG_FORMAT", Some("text"),
            "Log format: text or json (filter with RUST_LOG)");
        // Backfill (issue 11, crate::setup::backfill): rows already in the table when the slot is
        // created.
        BACKFILL = ("backfill", "OUTBOX_RELAY_BACKFILL", Some("pending"),
            "When the relay creates its slot, publish the rows already in the table, read in the slot's exported snapshot: pending (rows whose status is 'pending'; none if the table has no status column), all, or none");
        // Marking and retention (issue 11 parts 3 and 4: crate::process::mark,
        // crate::process::retention).
        MARK_PUBLISHED = ("mark_published", "OUTBOX_RELAY_MARK_PUBLISHED", Some("false"),
            "After JetStream acknowledged events, set status = 'published', published_at = now(), attempts = attempts + 1 on their rows, in batches beside the session (needs those columns and UPDATE on them; the slot is confirmed only past marked rows)");
        RETENTION_GRACE = ("retention_grace", "OUTBOX_RELAY_RETENTION_GRACE", Some("off"),
            "Delete rows older than this (e.g. 7d) once the slot confirmed them, in small batches while this relay holds the lease, or off; rows committed before the slot existed count as confirmed (docs/operations.md)");
        RETENTION_BATCH = ("retention_batch", "OUTBOX_RELAY_RETENTION_BATCH", Some("1000"),
            "Rows per retention DELETE (1 to 100000)");
        RETENTION_INTERVAL = ("retention_interval", "OUTBOX_RELAY_RETENTION_INTERVAL", Some("60s"),
            "How often retention looks for old confirmed rows");
        // Metrics and health (crate::observe::metrics, crate::observe::http): MetricsConfig.
        METRICS_ADDR = ("metrics_addr", "OUTBOX_RELAY_METRICS_ADDR", None,
            "Serve Prometheus metrics (/metrics) and health (/healthz, /readyz) over HTTP on this address, e.g. 0.0.0.0:9464, [::]:9464, :9464 (all interfaces) or 127.0.0.1:0 (a free port, logged); off unless set");
    }
}
/// The `nats` CLI's environment variables the relay honours, below its own variables and its
/// config file: an operator's shell set up for `nats` works for the relay too, and
/// `OUTBOX_RELAY_*` or the file still win.
pub const NATS_CLI_ENV: [(&str, &OptionSpec); 7] = [
    ("NATS_USER", &opt::NATS_USER),
    ("NATS_PASSWORD", &opt::NATS_PASSWORD),
    ("NATS_CREDS", &opt::NATS_CREDS),
    ("NATS_NKEY", &opt::NATS_NKEY),
    ("NATS_CA", &opt::NATS_TLSCA),
    ("NATS_CERT", &opt::NATS_TLSCERT),
    ("NATS_KEY", &opt::NATS_TLSKEY),
];
