//! One rendering of an error Postgres returns, used wherever the relay reports one: the
//! server's message, its detail and hint, and the SQLSTATE, on one line; an error that did not
//! come from the server (a lost connection, a refused handshake) with its cause
//! ([`describe`], the replication crate's: the consumer library renders its errors with it
//! too).
//!
//! Whether the relay tries again is read from the SQLSTATE, transient unless proven otherwise
//! (`replication::sqlstate_is_transient`); an error without one (the connection) is transient.

pub use replication::describe;

/// Whether the next attempt may succeed: by SQLSTATE, transient unless proven otherwise; an
/// error without one (the connection failed) is transient.
pub fn is_transient(error: &tokio_postgres::Error) -> bool {
    error
        .code()
        .is_none_or(|code| replication::sqlstate_is_transient(code.code()))
}
