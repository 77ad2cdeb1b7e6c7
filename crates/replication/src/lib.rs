//! Our own Postgres logical replication transport: connection, authentication, TLS,
//! CopyBoth streaming and standby status feedback.
//!
//! Upstream tokio-postgres has no CopyBoth support, and the forks that add it are git-only,
//! so this crate speaks the protocol itself on top of `postgres-protocol` (message encoding,
//! MD5 and SCRAM), tokio and tokio-rustls (ring). Replication messages are decoded by the
//! `pgoutput` crate.
//!
//! - [`ConnInfo`]: a libpq URL or key=value string, with libpq's `PG*` environment,
//!   password file, defaults and quoting, and where each value came from.
//! - [`ReplicationConnection`]: a `replication=database` session; `IDENTIFY_SYSTEM`,
//!   `SHOW`, plain SQL, then `START_REPLICATION ... LOGICAL`.
//! - [`ReplicationStream`]: cancel-safe `recv` of `XLogData`/`PrimaryKeepalive`,
//!   `send_status`, `finish`; [`Feedback`] decides when status updates go out and what they
//!   say (see [`stream`] for the policy).
//! - [`tls`]: libpq's `sslmode` semantics on rustls, client certificates; [`connect_sql`]
//!   opens a control-plane tokio-postgres connection under the same policy (socket, TLS,
//!   the authentication checks of the `auth` module, connect timeout).
//! - [`Error`]: split by what the caller must do ([`Error::is_transient`]).
//!
//! ```ignore
//! let info: ConnInfo = std::env::var("DATABASE_URL")?.parse()?;
//! let mut connection = ReplicationConnection::connect(&info).await?;
//! let interval = status_interval(connection.wal_sender_timeout().await?);
//! let names = publication_names(&["outbox"]);
//! let mut stream = connection
//!     .start_logical_replication("relay", resume_lsn, &[
//!         ("proto_version", "1"),
//!         ("publication_names", &names),
//!     ])
//!     .await?;
//! ```
//!
//! # Invariants
//! - R1 The stream never reports a flush position it was not given: a status update says
//!   `write = flush = apply =` the LSN last passed to [`Feedback::update`] (or to
//!   [`ReplicationStream::send_status`]), which is monotonic; before any, `0/0`, which the
//!   server ignores.
//! - R2 While connected, a status update goes out at least every [`status_interval`]
//!   (`min(10 s, wal_sender_timeout / 2)`), whatever the data flow, provided the caller
//!   sends when [`Feedback::next_due`] says so; and at once when a keepalive asks.
//! - R3 [`ReplicationStream::recv`] is cancel-safe: a dropped `recv` loses no byte, and the
//!   next one returns the message the dropped one was reading.
//! - R4 Passwords never appear in errors, logs or `Debug` output: they live in a [`Secret`],
//!   and targets are shown by [`ConnInfo::redacted`].
//! - R5 The session is pinned (`client_encoding=UTF8`, `DateStyle=ISO`, `TimeZone=UTC`,
//!   `standard_conforming_strings=on`) and checked after startup: pgoutput's text output,
//!   from which the relay derives keys, does not depend on server or role settings. In a
//!   `SQL_ASCII` database, which stores bytes unchecked, the session then takes text as
//!   stored (`client_encoding=SQL_ASCII`), so one row that is not UTF-8 cannot stop the
//!   stream: the relay checks each value it publishes (`outbox` E1, `sink` P7).
//! - R6 The end of a logical stream is always an error (transient): the server never ends
//!   a healthy one on its own. So is, with [`ReplicationStream::set_idle_timeout`], a server
//!   that stops answering heartbeats.
//! - R7 Both connections authenticate under one policy (`channel_binding`, `require_auth`,
//!   the `auth` module): a request the policy refuses is refused before anything is sent in
//!   reply, and `channel_binding=require` never falls back to cleartext, md5, plain SCRAM
//!   or no authentication. Connecting (TCP, TLS, authentication) is bounded by
//!   `connect_timeout`, [`DEFAULT_CONNECT_TIMEOUT`] when not given.

mod auth;
pub mod connection;
pub mod conninfo;
pub mod error;
pub mod modes;
mod sql;
pub mod stream;
pub mod tls;
mod wire;

pub use connection::{
    publication_names, quote_identifier, quote_literal, ExportedSlot, IdentifySystem,
    ReplicationConnection,
};
pub use conninfo::{
    conninfo_pairs, quote_conninfo_value, AuthMethod, ChannelBinding, ConnInfo, LoadBalanceHosts,
    ParseSslModeError, RequireAuth, RootCerts, Secret, Source, SslMode, TargetSessionAttrs,
    DEFAULT_CONNECT_TIMEOUT,
};
pub use error::{describe, sqlstate_is_transient, DbError, Error};
pub use pgoutput::{Lsn, PrimaryKeepalive, ReplicationMessage, StandbyStatusUpdate, XLogData};
pub use sql::connect_sql;
pub use stream::{
    parse_wal_sender_timeout, pg_timestamp, reply_requested, status_interval, Feedback,
    ReplicationStream, PROGRESS_INTERVAL,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn send<T: Send>(_: &T) {}
    fn error_type<T: std::error::Error + Send + Sync + 'static>() {}

    /// Type-checked only: the relay spawns tasks that own these and await their futures.
    #[allow(dead_code)]
    async fn futures_are_send(info: ConnInfo, mut stream: ReplicationStream) {
        send(&ReplicationConnection::connect(&info));
        send(&connect_sql(&info));
        send(&stream.recv());
        let update = Feedback::new(status_interval(None)).status(std::time::SystemTime::now());
        send(&stream.send_status(update));
        send(&stream.finish());
    }

    #[test]
    fn public_types_fit_in_tasks_and_anyhow() {
        error_type::<Error>();
        fn send_type<T: Send + 'static>() {}
        send_type::<ReplicationConnection>();
        send_type::<ReplicationStream>();
        send_type::<ConnInfo>();
        send_type::<Feedback>();
    }
}
