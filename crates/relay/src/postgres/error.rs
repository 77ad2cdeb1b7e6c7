//! One rendering of an error Postgres returns, used wherever the relay reports one: the
//! server's message, its detail and hint, and the SQLSTATE, on one line; an error that did not
//! come from the server (a lost connection, a refused handshake) with its cause.
//!
//! Whether the relay tries again is read from the SQLSTATE, transient unless proven otherwise
//! (`replication::sqlstate_is_transient`); an error without one (the connection) is transient.

/// `error` on one line: `message (SQLSTATE code); detail: …; hint: …` for an error the server
/// returned, else what failed and its cause (`error connecting to server: Connection refused`).
pub fn describe(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => {
            let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                text.push_str(&format!("; detail: {detail}"));
            }
            if let Some(hint) = db.hint() {
                text.push_str(&format!("; hint: {hint}"));
            }
            text
        }
        None => match std::error::Error::source(error) {
            Some(cause) => format!("{error}: {cause}"),
            None => error.to_string(),
        },
    }
}

/// Whether the next attempt may succeed: by SQLSTATE, transient unless proven otherwise; an
/// error without one (the connection failed) is transient.
pub fn is_transient(error: &tokio_postgres::Error) -> bool {
    error
        .code()
        .is_none_or(|code| replication::sqlstate_is_transient(code.code()))
}
