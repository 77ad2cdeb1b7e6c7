//! The control connection: an ordinary (non-replication) SQL session for the relay's
//! control plane (lease, bootstrap SQL, slot checks), run by tokio-postgres.
//!
//! tokio-postgres does the job for the startup, SCRAM (with channel binding when the TLS
//! stream reports its `tls-server-end-point` hash, and its own refusal of downgrades under
//! `channel_binding=require`), queries and type conversions. What it lacks, we do before
//! handing it the socket, with the same code as the replication connection, so that both
//! connections follow one policy: the socket (TCP or Unix), TLS per libpq's `sslmode` with
//! `sslrootcert`/`sslcert`/`sslkey` ([`crate::connection::open`]); `require_auth`, and the
//! refusal of a request before anything is sent, through [`crate::auth::AuthGuard`]; and a
//! connect timeout that bounds TCP, TLS and authentication together (tokio-postgres'
//! `connect_timeout` bounds the TCP connect only). tokio-postgres then sees an established
//! stream: TLS is announced as "direct" so that it sends no SSLRequest of its own.

use std::future::Future;
use std::pin::Pin;
use std::sync::PoisonError;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::config::{
    ChannelBinding as PgChannelBinding, SslMode as PgSslMode, SslNegotiation,
};

use crate::auth::{AuthCheck, AuthGuard, Transport};
use crate::connection::{connect_first, open};
use crate::conninfo::{ChannelBinding, ConnInfo};
use crate::error::DbError;
use crate::wire::BoxSocket;
use crate::Error;

/// Opens an ordinary SQL connection (not a replication connection) under the same
/// connection policy as [`crate::ReplicationConnection::connect`], and spawns its
/// connection task on the current tokio runtime.
///
/// The session is pinned like the replication session: `TimeZone=UTC`, `DateStyle=ISO`,
/// `standard_conforming_strings=on` (which [`crate::quote_literal`] relies on), and the
/// `application_name` of `info` if it has one.
///
/// With several hosts, the first that connects and is what `target_session_attrs` asks for
/// (libpq's host loop, shared with the replication connection: `connect_first`).
pub async fn connect_sql(info: &ConnInfo) -> Result<tokio_postgres::Client, Error> {
    connect_first(info, |target, attrs| async move {
        let redacted = target.redacted();
        let (client, connection) = connect(&target, &redacted).await?;
        let task = tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::warn!(target = %redacted, error = %error, "sql connection failed");
            }
        });
        let Some(query) = attrs.check_query() else {
            return Ok(Ok(client));
        };
        let failed = |source| Error::Sql {
            context: format!("{query} on {}", target.redacted()),
            source,
        };
        let answer = client
            .simple_query(query)
            .await
            .map_err(failed)?
            .into_iter()
            .find_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            })
            .unwrap_or_default();
        match attrs.accepts(&answer) {
            Ok(()) => Ok(Ok(client)),
            Err(instead) => {
                drop(client);
                task.abort();
                Ok(Err(instead))
            }
        }
    })
    .await
}

type Connection = tokio_postgres::Connection<AuthGuard<BoxSocket>, AuthGuard<BoxSocket>>;
type ConnectResult = Result<(tokio_postgres::Client, Connection), tokio_postgres::Error>;

async fn connect(
    info: &ConnInfo,
    target: &str,
) -> Result<(tokio_postgres::Client, Connection), Error> {
    let (socket, transport) = open(info, target).await?;
    let (socket, refusal) = AuthGuard::new(socket, AuthCheck::new(info, &transport)?);
    let end_point = match transport {
        Transport::Tls { end_point } => Some(end_point),
        Transport::Plain => None,
    };

    let mut config = tokio_postgres::Config::new();
    config
        .user(info.user())
        .dbname(info.dbname())
        .options("-c TimeZone=UTC -c DateStyle=ISO -c standard_conforming_strings=on -c bytea_output=hex")
        .channel_binding(match info.channel_binding() {
            ChannelBinding::Disable => PgChannelBinding::Disable,
            ChannelBinding::Prefer => PgChannelBinding::Prefer,
            ChannelBinding::Require => PgChannelBinding::Require,
        })
        // TLS (if any) is already up: "direct" makes tokio-postgres call our connector
        // without an SSLRequest.
        .ssl_mode(if end_point.is_some() {
            PgSslMode::Require
        } else {
            PgSslMode::Disable
        })
        .ssl_negotiation(SslNegotiation::Direct);
    if let Some(password) = info.password() {
        config.password(password.expose());
    }
    if let Some(name) = info.application_name() {
        config.application_name(name);
    }
    let established = Established {
        end_point: end_point.flatten(),
    };
    // Boxed as a `Send` future: unboxed, rustc cannot prove the caller's future `Send` for
    // every lifetime of its borrows (a higher-ranked inference limit with this generic
    // future of tokio-postgres).
    let connecting: Pin<Box<dyn Future<Output = ConnectResult> + Send + '_>> =
        Box::pin(config.connect_raw(socket, established));
    let error = match connecting.await {
        Ok(connected) => return Ok(connected),
        Err(error) => error,
    };
    let refused = refusal
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    Err(match (refused, error.as_db_error()) {
        (Some(refused), _) => refused,
        (None, Some(db)) => Error::from(DbError::from_tokio_postgres(db, info.user())),
        (None, None) => Error::Sql {
            context: format!("could not connect to Postgres at {target}"),
            source: error,
        },
    })
}

/// tokio-postgres' TLS hook for a stream whose TLS handshake is already done: the guarded
/// stream itself, which reports the `tls-server-end-point` hash for channel binding.
#[derive(Debug, Clone)]
struct Established {
    end_point: Option<Vec<u8>>,
}

impl<S> tokio_postgres::tls::TlsConnect<AuthGuard<S>> for Established
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = AuthGuard<S>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<AuthGuard<S>, Error>> + Send>>;

    fn connect(self, mut stream: AuthGuard<S>) -> Self::Future {
        stream.end_point = self.end_point;
        Box::pin(async move { Ok(stream) })
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for AuthGuard<S> {
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        match &self.end_point {
            Some(hash) => tokio_postgres::tls::ChannelBinding::tls_server_end_point(hash.clone()),
            None => tokio_postgres::tls::ChannelBinding::none(),
        }
    }
}
