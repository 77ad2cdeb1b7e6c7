//! replication
