//! The `Outbox-Source` header value: which history a message's position belongs to.
//!
//! A position (commit LSN, index in transaction) orders events only within one WAL history:
//! one cluster (system identifier), one timeline (a fail-over or a point-in-time restore
//! starts a new one and reuses LSNs from its branch point), one database and one slot. The
//! relay skips replayed events by the stream's tail only when the tail carries its own
//! source.
//!
//! # Invariants
//! - SRC1 The value names the system identifier, the timeline, the database and the slot:
//!   `{system_identifier}/{timeline}/{database}/{slot}`.
//! - SRC2 The value is a valid NATS header value that contains no `Nats-` header name in any
//!   case: the database name (any text) is [`encoding::encode`]d like a hostile row's values
//!   (every byte outside `[A-Za-z0-9_.~:]` as `%XX`), so it cannot break or subvert the
//!   header block, and two different databases never share a source.

use crate::encoding;

/// The `Outbox-Source` value for a slot of `database` on timeline `timeline` of the cluster
/// `system_identifier` (SRC1, SRC2).
pub fn source_id(system_identifier: &str, timeline: u32, database: &str, slot: &str) -> String {
    format!(
        "{system_identifier}/{timeline}/{}/{slot}",
        encoding::encode(database)
    )
}

#[cfg(test)]
mod tests {
    use super::source_id;

    #[test]
    fn names_cluster_timeline_database_and_slot() {
        assert_eq!(
            source_id("7301", 3, "app", "outbox_relay"),
            "7301/3/app/outbox_relay"
        );
    }

    #[test]
    fn a_database_name_cannot_break_the_header_or_hide_a_header_name() {
        let source = source_id("1", 1, "a/b\r\nNats-Msg-Id: x%", "s");
        assert_eq!(source, "1/1/a%2Fb%0D%0ANats%2DMsg%2DId:%20x%25/s");
        assert!(!source.to_ascii_lowercase().contains("nats-"));
        assert!(!source.bytes().any(|b| b.is_ascii_control()));
        // Different databases, different sources (the encoding is injective).
        assert_ne!(
            source_id("1", 1, "a/b", "s"),
            source_id("1", 1, "a%2Fb", "s")
        );
    }
}
