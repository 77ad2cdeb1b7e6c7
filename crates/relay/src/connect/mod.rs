//! Connecting: the Postgres and NATS connections the configuration describes, and what a
//! session's or a backfill's sink is given to publish with. Postgres connections are
//! `replication::connect_sql` and `ReplicationConnection` over `Config::database`; NATS
//! connections are [`nats`]'s.
//!
//! May use: `config`, `error`. Used by the streaming process and the commands; never uses
//! them.

use async_nats::jetstream;
use sink::SinkOptions;

use crate::config::Config;
use crate::error::{Result, Target};

pub mod nats;

/// Connects to NATS (credentials and TLS: [`nats`]).
pub async fn connect_nats(config: &Config) -> Result<async_nats::Client> {
    nats::connect(&config.nats)
        .await
        .map_err(|e| e.at(Target::Nats))
}

/// A JetStream context for the relay's publishing.
pub fn jetstream_context(client: async_nats::Client, config: &Config) -> jetstream::Context {
    jetstream::context::ContextBuilder::new()
        .timeout(config.ack_timeout)
        .max_ack_inflight(config.max_in_flight + 1)
        .build(client)
}

/// The `Outbox-Source` of what this connection's server publishes through the slot. P6, I6:
/// positions are comparable only within one timeline of one cluster's database and slot;
/// the source names all four.
pub(crate) fn source(system: &replication::IdentifySystem, config: &Config) -> String {
    outbox::source::source_id(
        &system.systemid,
        system.timeline,
        system.dbname.as_deref().unwrap_or(config.database.dbname()),
        &config.slot,
    )
}

/// The largest message the server and the stream accept.
pub(crate) fn max_message_bytes(tail: &sink::resume::Tail, max_payload: usize) -> usize {
    match tail.max_msg_size {
        Some(limit) => limit.min(max_payload),
        None => max_payload,
    }
}

/// How the sink publishes: a session's, or a backfill's (`crate::setup::backfill`).
pub(crate) fn sink_options(
    config: &Config,
    fence: Option<u64>,
    max_message_bytes: usize,
    source: String,
    replicas: usize,
) -> SinkOptions {
    SinkOptions {
        max_in_flight: config.max_in_flight,
        fence,
        compare: None,
        limits: sink::Limits {
            max_message_bytes,
            max_control_line: sink::DEFAULT_MAX_CONTROL_LINE,
        },
        poison: config.on_poison,
        dead_letter_subject: format!("{}.dlq", config.subject_prefix),
        source,
        ack_timeout: config.ack_timeout,
        atomic: None,
        fast: None,
        id_chain: replicas <= 1,
    }
}
