//! The transaction a handler writes through: tokio-postgres's own, with the statements it
//! runs by text prepared once per connection.
//!
//! `tx.execute("insert …", &params)` on a plain `tokio_postgres::Transaction` prepares the
//! text every time (Parse and Describe, a round trip and a parse in the backend) before it
//! binds and executes it: for a per-event handler that is most of its statement's cost. This
//! [`Transaction`] dereferences to tokio-postgres's, so a handler is written exactly as
//! against it, and shadows the methods a handler calls with SQL text (`execute`, `query`,
//! `query_one`, `query_opt`, `prepare`) with ones that look the text up in the
//! connection's statements first.
//!
//! # Invariants
//! - T1 A text is prepared at most once per connection while it is cached; what a
//!   statement does is what the text says (the cache is keyed by the exact text, and a
//!   prepared statement is tokio-postgres's, bound with the parameters given).
//! - T2 The cache belongs to one connection and goes with it: a reopened connection starts
//!   empty. Prepared statements are session state, untouched by a rollback.
//! - T3 At most [`CACHED_STATEMENTS`] texts are cached per connection; others are prepared
//!   per call, as tokio-postgres does (a handler that formats values into its SQL cannot
//!   grow the server's or the consumer's memory).
//! - T4 A cached statement the server no longer accepts as prepared (its result type
//!   changed with the schema: SQLSTATE 0A000; or it was deallocated: 26000) is dropped
//!   from the cache when it fails, so the event's retry prepares it again.

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, Row, Statement};

/// How many SQL texts a connection keeps prepared for handlers (T3).
pub const CACHED_STATEMENTS: usize = 64;

/// A handler's transaction: see the module docs. Everything of
/// `tokio_postgres::Transaction` is available through it.
pub struct Transaction<'a> {
    inner: tokio_postgres::Transaction<'a>,
    statements: &'a Statements,
}

/// The statements a connection prepared for handlers, by text (T1–T3).
#[derive(Debug, Default)]
pub(crate) struct Statements {
    by_text: Mutex<HashMap<String, Statement>>,
}

impl Statements {
    fn get(&self, text: &str) -> Option<Statement> {
        self.lock().get(text).cloned()
    }

    fn keep(&self, text: &str, statement: &Statement) {
        let mut by_text = self.lock();
        if by_text.len() < CACHED_STATEMENTS {
            by_text.insert(text.to_owned(), statement.clone());
        }
    }

    fn forget(&self, text: &str) {
        self.lock().remove(text);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Statement>> {
        // Never held across an await, and a map of clones cannot be left inconsistent.
        self.by_text
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// SQL a [`Transaction`] method accepts, like tokio-postgres's `ToStatement`: text (`str`,
/// `String`) or a prepared [`Statement`].
pub trait Sql: sealed::Sealed + Sync {
    #[doc(hidden)]
    fn sql(&self) -> SqlRef<'_>;
}

/// What [`Sql`] is.
#[doc(hidden)]
#[derive(Debug)]
pub enum SqlRef<'a> {
    Text(&'a str),
    Prepared(&'a Statement),
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for str {}
    impl Sealed for String {}
    impl Sealed for tokio_postgres::Statement {}
}

impl Sql for str {
    fn sql(&self) -> SqlRef<'_> {
        SqlRef::Text(self)
    }
}

impl Sql for String {
    fn sql(&self) -> SqlRef<'_> {
        SqlRef::Text(self)
    }
}

impl Sql for Statement {
    fn sql(&self) -> SqlRef<'_> {
        SqlRef::Prepared(self)
    }
}

type Params<'p> = &'p [&'p (dyn ToSql + Sync)];

/// Writes `tokio_postgres::Transaction`'s statement-running methods over the prepared-once
/// statement cache (each the same three steps: prepare or reuse, run, check the outcome).
macro_rules! prepared_once {
    ($($name:ident -> $out:ty),*) => {$(
        #[doc = concat!("`tokio_postgres::Transaction::", stringify!($name), "`, with text prepared once per connection.")]
        pub async fn $name<T: ?Sized + Sql>(
            &self,
            statement: &T,
            params: Params<'_>,
        ) -> Result<$out, Error> {
            let prepared = self.statement(statement).await?;
            let result = self.inner.$name(&prepared, params).await;
            self.checked(statement, result)
        }
    )*};
}

impl<'a> Transaction<'a> {
    pub(crate) fn new(inner: tokio_postgres::Transaction<'a>, statements: &'a Statements) -> Self {
        Transaction { inner, statements }
    }

    pub(crate) fn into_inner(self) -> tokio_postgres::Transaction<'a> {
        self.inner
    }

    /// Prepares `query`, or gives the connection's statement prepared for that text before.
    pub async fn prepare(&self, query: &str) -> Result<Statement, Error> {
        if let Some(statement) = self.statements.get(query) {
            return Ok(statement);
        }
        let statement = self.inner.prepare(query).await?;
        self.statements.keep(query, &statement);
        Ok(statement)
    }

    // `execute`, `query`, `query_one` and `query_opt`: `tokio_postgres::Transaction`'s
    // methods of the same names, with the text prepared once per connection.
    prepared_once!(execute -> u64, query -> Vec<Row>, query_one -> Row, query_opt -> Option<Row>);

    async fn statement<T: ?Sized + Sql>(&self, statement: &T) -> Result<Statement, Error> {
        match statement.sql() {
            SqlRef::Text(text) => self.prepare(text).await,
            SqlRef::Prepared(statement) => Ok(statement.clone()),
        }
    }

    /// T4: a cached statement the server refuses as prepared is prepared afresh next time.
    fn checked<T: ?Sized + Sql, R>(
        &self,
        statement: &T,
        result: Result<R, Error>,
    ) -> Result<R, Error> {
        if let (Err(error), SqlRef::Text(text)) = (&result, statement.sql()) {
            let stale = error.code().is_some_and(|code| {
                *code == SqlState::FEATURE_NOT_SUPPORTED
                    || *code == SqlState::INVALID_SQL_STATEMENT_NAME
            });
            if stale {
                self.statements.forget(text);
            }
        }
        result
    }
}

impl<'a> Deref for Transaction<'a> {
    type Target = tokio_postgres::Transaction<'a>;

    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl DerefMut for Transaction<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl std::fmt::Debug for Transaction<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction").finish_non_exhaustive()
    }
}
