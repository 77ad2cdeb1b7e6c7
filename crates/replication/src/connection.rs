//! A replication-mode connection (`replication=database`) before streaming starts.
//!
//! [`ReplicationConnection::connect`] runs the whole startup: socket (TCP with `TCP_NODELAY`,
//! or a Unix socket), TLS negotiation per `sslmode` (see [`crate::tls`]), the StartupMessage,
//! authentication (trust, cleartext password, MD5, SCRAM-SHA-256 with
//! `tls-server-end-point` channel binding when on TLS and offered, as `channel_binding`
//! allows), each request of the server checked by `auth::AuthCheck` before it is
//! answered (`channel_binding`, `require_auth`), and the check that the session settings we
//! pin came back as asked. `connect_timeout` bounds all of it (`with_connect_timeout`).
//! The socket and TLS part (`open`) serves the control connection too
//! ([`crate::connect_sql`]).
//!
//! The pinned settings decide how the server renders values as text, which the relay
//! derives keys from: `client_encoding=UTF8`, `DateStyle=ISO` (timestamptz as
//! `2024-01-02 03:04:05.678+00`), `TimeZone=UTC`, and `standard_conforming_strings=on` (so
//! that [`quote_literal`] is right in SQL as in replication commands).
//!
//! Then: plain SQL and replication commands on the simple-query protocol
//! ([`ReplicationConnection::simple_query`], [`ReplicationConnection::identify_system`],
//! [`ReplicationConnection::timeline_history`],
//! [`ReplicationConnection::wal_sender_timeout`]), and
//! [`ReplicationConnection::start_logical_replication`], which turns the connection into a
//! [`ReplicationStream`].
//!
//! None of the methods here is cancel-safe (a cancelled query leaves its reply unread);
//! only the stream's `recv` is.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use bytes::BytesMut;
use pgoutput::Lsn;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{
    ChannelBinding as SaslBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::{TcpStream, UnixStream};

use crate::auth::{self, AuthCheck, Transport};
use crate::conninfo::{ChannelBinding, ConnInfo, SslMode, TargetSessionAttrs};
use crate::stream::{parse_wal_sender_timeout, ReplicationStream};
use crate::wire::{self, Authentication, BoxSocket, FrameReader, FrameWriter};
use crate::{tls, Error};

/// The reply to `IDENTIFY_SYSTEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentifySystem {
    /// The cluster's system identifier.
    pub systemid: String,
    /// The current timeline.
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    /// The database connected to.
    pub dbname: Option<String>,
}

/// A slot created with an exported snapshot
/// ([`ReplicationConnection::create_logical_slot_exporting_snapshot`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportedSlot {
    /// The slot's consistent point: every transaction committed before it is in the
    /// snapshot, every one committed after it is streamed from the slot.
    pub consistent_point: Lsn,
    /// The exported snapshot's name, for `SET TRANSACTION SNAPSHOT`.
    pub snapshot: String,
}

/// A connection in replication mode, ready for commands.
pub struct ReplicationConnection {
    reader: FrameReader<ReadHalf<BoxSocket>>,
    writer: FrameWriter<WriteHalf<BoxSocket>>,
    parameters: BTreeMap<String, String>,
    backend_pid: Option<i32>,
    user: String,
    target: String,
    tls: bool,
    sasl_mechanism: Option<&'static str>,
}

impl fmt::Debug for ReplicationConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicationConnection")
            .field("target", &self.target)
            .field("backend_pid", &self.backend_pid)
            .field("tls", &self.tls)
            .field("sasl_mechanism", &self.sasl_mechanism)
            .finish_non_exhaustive()
    }
}

/// Settings we send in the StartupMessage and insist on getting back.
const PINNED: &[(&str, &str)] = &[
    ("client_encoding", "UTF8"),
    ("DateStyle", "ISO"),
    ("TimeZone", "UTC"),
    ("standard_conforming_strings", "on"),
];

/// Where authentication stands after one request is answered.
enum AuthStep {
    /// `AuthenticationOk`.
    Authenticated,
    /// An answer is written, to be sent.
    Answered,
    /// SCRAM's final message checked: nothing to send.
    Verified,
}

impl ReplicationConnection {
    /// Connects and authenticates; see the module docs. With several hosts, the first that
    /// connects and is what `target_session_attrs` asks for ([`connect_first`]).
    pub async fn connect(info: &ConnInfo) -> Result<Self, Error> {
        connect_first(info, |target, attrs| async move {
            let mut connection = Self::connect_inner(&target, target.redacted()).await?;
            let Some(query) = attrs.check_query() else {
                return Ok(Ok(connection));
            };
            let rows = connection.simple_query(query).await?;
            let answer = match rows.first().map(Vec::as_slice) {
                Some([Some(answer)]) => answer.clone(),
                _ => {
                    return Err(Error::protocol(format!(
                        "unexpected reply {rows:?} to {query}"
                    )))
                }
            };
            match attrs.accepts(&answer) {
                Ok(()) => Ok(Ok(connection)),
                Err(instead) => {
                    let _ = connection.close().await;
                    Ok(Err(instead))
                }
            }
        })
        .await
    }

    async fn connect_inner(info: &ConnInfo, target: String) -> Result<Self, Error> {
        let (socket, transport) = open(info, &target).await?;
        Self::start_session(socket, transport, info, target).await
    }

    /// Startup, authentication and the settings check on an open socket.
    async fn start_session(
        socket: BoxSocket,
        transport: Transport,
        info: &ConnInfo,
        target: String,
    ) -> Result<Self, Error> {
        let tls = matches!(transport, Transport::Tls { .. });
        let (read, write) = tokio::io::split(socket);
        let mut connection = ReplicationConnection {
            reader: FrameReader::new(read, target.clone()),
            writer: FrameWriter::new(write, target.clone()),
            parameters: BTreeMap::new(),
            backend_pid: None,
            user: info.user().to_owned(),
            target,
            tls,
            sasl_mechanism: None,
        };
        connection.startup(info, transport).await?;
        connection.check_pinned_settings()?;
        if connection.parameter("server_encoding") == Some("SQL_ASCII") {
            // R5: a SQL_ASCII database stores bytes unchecked; converting them to UTF-8
            // would fail the whole stream at one row that is not UTF-8, so the session takes
            // text as stored and the caller checks what it publishes.
            connection
                .simple_query("SET client_encoding = 'SQL_ASCII'")
                .await?;
        }
        tracing::debug!(
            target = %connection.target,
            backend_pid = connection.backend_pid,
            tls = connection.tls,
            server_version = connection.parameter("server_version").unwrap_or(""),
            "replication connection established"
        );
        Ok(connection)
    }

    /// The startup message, authentication, then the server's parameters up to
    /// `ReadyForQuery`.
    async fn startup(&mut self, info: &ConnInfo, transport: Transport) -> Result<(), Error> {
        let check = AuthCheck::new(info, &transport)?;
        self.send_startup(info).await?;
        self.authenticate(info, &transport, check).await?;
        self.await_ready().await
    }

    /// The startup message: the user, the database in replication mode, the pinned settings
    /// and the application name.
    async fn send_startup(&mut self, info: &ConnInfo) -> Result<(), Error> {
        let mut parameters = vec![
            ("user", info.user()),
            ("database", info.dbname()),
            ("replication", "database"),
        ];
        parameters.extend_from_slice(PINNED);
        if let Some(name) = info.application_name() {
            parameters.push(("application_name", name));
        }
        frontend::startup_message(parameters, &mut self.writer.buf).map_err(|_| {
            Error::Config("user, dbname and application_name must not contain NUL".to_owned())
        })?;
        self.writer.flush().await
    }

    /// Answers the server's authentication requests, each first passed by `check`, until
    /// `AuthenticationOk`.
    async fn authenticate(
        &mut self,
        info: &ConnInfo,
        transport: &Transport,
        mut check: AuthCheck,
    ) -> Result<(), Error> {
        let mut scram: Option<ScramSha256> = None;
        loop {
            let frame = self.reader.next_frame("while authenticating").await?;
            match frame.tag {
                wire::AUTHENTICATION => {
                    let request = wire::authentication(&frame.body)
                        .and_then(|request| check.on_request(&request).map(|()| request))?;
                    match self.answer(request, info, transport, &mut scram)? {
                        AuthStep::Authenticated => return Ok(()),
                        AuthStep::Verified => continue,
                        AuthStep::Answered => {}
                    }
                }
                wire::ERROR_RESPONSE => return Err(wire::error_response(&frame.body, &self.user)),
                wire::NOTICE_RESPONSE => wire::log_notice(&frame.body, &self.target),
                other => return Err(unexpected(other, "while authenticating")),
            }
            self.writer.flush().await?;
        }
    }

    /// Writes the answer to one authentication request (SCRAM's state in `scram`).
    fn answer(
        &mut self,
        request: Authentication,
        info: &ConnInfo,
        transport: &Transport,
        scram: &mut Option<ScramSha256>,
    ) -> Result<AuthStep, Error> {
        match request {
            Authentication::Ok => return Ok(AuthStep::Authenticated),
            Authentication::CleartextPassword => {
                let password = password(info)?;
                frontend::password_message(password.as_bytes(), &mut self.writer.buf)
                    .map_err(|_| nul_in_password())?;
            }
            Authentication::Md5Password { salt } => {
                let password = password(info)?;
                let hash = md5_hash(info.user().as_bytes(), password.as_bytes(), salt);
                frontend::password_message(hash.as_bytes(), &mut self.writer.buf)
                    .map_err(|_| nul_in_password())?;
            }
            Authentication::Sasl { mechanisms } => {
                *scram = Some(self.start_sasl(&mechanisms, info, transport)?);
            }
            Authentication::SaslContinue(data) => {
                let state = scram
                    .as_mut()
                    .ok_or_else(|| Error::protocol("SASL continuation without SASL start"))?;
                state.update(&data).map_err(|e| {
                    Error::Auth(format!("invalid SCRAM message from the server: {e}"))
                })?;
                frontend::sasl_response(state.message(), &mut self.writer.buf)
                    .map_err(|e| Error::Auth(format!("cannot encode SCRAM message: {e}")))?;
            }
            Authentication::SaslFinal(data) => {
                let state = scram
                    .as_mut()
                    .ok_or_else(|| Error::protocol("SASL final message without SASL start"))?;
                // Verifies that the server knows the password too.
                state.finish(&data).map_err(|e| {
                    Error::Auth(format!(
                        "the server failed to prove it knows the password ({e}); \
                         this can mean a man-in-the-middle"
                    ))
                })?;
                return Ok(AuthStep::Verified);
            }
            Authentication::Unsupported(code) => {
                return Err(Error::Auth(format!(
                    "the server asks for {}, which this client does not implement; \
                     hint: use scram-sha-256, md5, password or trust for this user in \
                     pg_hba.conf",
                    auth_method_name(code)
                )))
            }
        }
        Ok(AuthStep::Answered)
    }

    /// SASL's first message: the mechanism chosen from the server's `mechanisms` (with
    /// channel binding over TLS when allowed) and SCRAM's first message; returns SCRAM's
    /// state for the messages that follow.
    fn start_sasl(
        &mut self,
        mechanisms: &[String],
        info: &ConnInfo,
        transport: &Transport,
    ) -> Result<ScramSha256, Error> {
        let password = password(info)?;
        let (mechanism, binding) = choose_sasl(mechanisms, transport, info.channel_binding())?;
        let state = ScramSha256::new(password.as_bytes(), binding);
        frontend::sasl_initial_response(mechanism, state.message(), &mut self.writer.buf)
            .map_err(|e| Error::Auth(format!("cannot encode SCRAM message: {e}")))?;
        self.sasl_mechanism = Some(mechanism);
        Ok(state)
    }

    /// After authentication: the server's parameters and the backend's key data, up to
    /// `ReadyForQuery`.
    async fn await_ready(&mut self) -> Result<(), Error> {
        loop {
            let frame = self.reader.next_frame("after authentication").await?;
            match frame.tag {
                wire::PARAMETER_STATUS => {
                    let (name, value) = wire::parameter_status(&frame.body)?;
                    self.parameters.insert(name, value);
                }
                wire::BACKEND_KEY_DATA => {
                    self.backend_pid = Some(wire::backend_pid(&frame.body)?);
                }
                wire::READY_FOR_QUERY => return Ok(()),
                wire::ERROR_RESPONSE => return Err(wire::error_response(&frame.body, &self.user)),
                wire::NOTICE_RESPONSE => wire::log_notice(&frame.body, &self.target),
                other => return Err(unexpected(other, "after authentication")),
            }
        }
    }

    fn check_pinned_settings(&self) -> Result<(), Error> {
        for (parameter, expected) in PINNED {
            let actual = self.parameter(parameter).unwrap_or("");
            let ok = match *parameter {
                // The server reports "ISO, MDY": the output format is what we pin.
                "DateStyle" => actual.starts_with("ISO"),
                _ => actual == *expected,
            };
            if !ok {
                return Err(Error::Setting {
                    parameter,
                    expected,
                    actual: actual.to_owned(),
                });
            }
        }
        Ok(())
    }

    /// A setting the server reported with ParameterStatus (`server_version`,
    /// `server_encoding`, `TimeZone`, ...).
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.parameters.get(name).map(String::as_str)
    }

    /// The server's version as a number (`150004` for 15.4), from `server_version`.
    pub fn server_version_num(&self) -> Option<u32> {
        let version = self.parameter("server_version")?;
        let numeric: String = version
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let mut parts = numeric.split('.').map(|p| p.parse::<u32>().ok());
        let major = parts.next()??;
        let minor = parts.next().flatten().unwrap_or(0);
        if major >= 10 {
            Some(major * 10_000 + minor)
        } else {
            let patch = parts.next().flatten().unwrap_or(0);
            Some(major * 10_000 + minor * 100 + patch)
        }
    }

    /// The process id of the walsender serving us.
    pub fn backend_pid(&self) -> Option<i32> {
        self.backend_pid
    }

    /// Whether the connection runs over TLS.
    pub fn is_tls(&self) -> bool {
        self.tls
    }

    /// The SASL mechanism used to authenticate (`SCRAM-SHA-256` or `SCRAM-SHA-256-PLUS`),
    /// if SASL was used.
    pub fn sasl_mechanism(&self) -> Option<&'static str> {
        self.sasl_mechanism
    }

    /// Runs `sql` (one or more statements, or a replication command) on the simple-query
    /// protocol and returns the rows of all statements, each column as text. A server error
    /// is returned after the server is ready again, so the connection stays usable.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, Error> {
        self.send_query(sql).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let frame = self.reader.next_frame("while running a query").await?;
            match frame.tag {
                wire::DATA_ROW => {
                    if error.is_none() {
                        rows.push(wire::data_row(&frame.body)?);
                    }
                }
                wire::ROW_DESCRIPTION
                | wire::COMMAND_COMPLETE
                | wire::EMPTY_QUERY_RESPONSE
                | wire::NOTIFICATION_RESPONSE => {}
                wire::ERROR_RESPONSE => {
                    error.get_or_insert_with(|| wire::error_response(&frame.body, &self.user));
                }
                wire::NOTICE_RESPONSE => wire::log_notice(&frame.body, &self.target),
                wire::PARAMETER_STATUS => {
                    let (name, value) = wire::parameter_status(&frame.body)?;
                    self.parameters.insert(name, value);
                }
                wire::READY_FOR_QUERY => break,
                wire::COPY_IN_RESPONSE | wire::COPY_OUT_RESPONSE | wire::COPY_BOTH_RESPONSE => {
                    return Err(Error::protocol(
                        "the query started COPY, which simple_query does not support",
                    ))
                }
                other => return Err(unexpected(other, "while running a query")),
            }
        }
        match error {
            Some(error) => Err(error),
            None => Ok(rows),
        }
    }

    async fn send_query(&mut self, sql: &str) -> Result<(), Error> {
        frontend::query(sql, &mut self.writer.buf)
            .map_err(|_| Error::protocol("a query must not contain a NUL byte"))?;
        self.writer.flush().await
    }

    /// `IDENTIFY_SYSTEM`: the system identifier, timeline, WAL flush position and database.
    pub async fn identify_system(&mut self) -> Result<IdentifySystem, Error> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let bad = || Error::protocol(format!("unexpected IDENTIFY_SYSTEM reply {rows:?}"));
        let [row] = rows.as_slice() else {
            return Err(bad());
        };
        let [Some(systemid), Some(timeline), Some(xlogpos), dbname] = row.as_slice() else {
            return Err(bad());
        };
        Ok(IdentifySystem {
            systemid: systemid.clone(),
            timeline: timeline.parse().map_err(|_| bad())?,
            xlogpos: xlogpos.parse().map_err(|_| bad())?,
            dbname: dbname.clone(),
        })
    }

    /// The content of `timeline`'s history file (`TIMELINE_HISTORY`): its ancestor timelines
    /// and where its history left each, one `parent_tli<TAB>switchpoint<TAB>reason` line
    /// each. Timeline 1 has no ancestors and no file: `""`, without asking.
    pub async fn timeline_history(&mut self, timeline: u32) -> Result<String, Error> {
        if timeline <= 1 {
            return Ok(String::new());
        }
        let rows = self
            .simple_query(&format!("TIMELINE_HISTORY {timeline}"))
            .await?;
        match rows.as_slice() {
            [row] => match row.as_slice() {
                [_, Some(content)] => Ok(content.clone()),
                _ => Err(Error::protocol(format!(
                    "unexpected TIMELINE_HISTORY reply {rows:?}"
                ))),
            },
            _ => Err(Error::protocol(format!(
                "unexpected TIMELINE_HISTORY reply {rows:?}"
            ))),
        }
    }

    /// The server's `wal_sender_timeout` (`None` when disabled), to derive the status
    /// interval from ([`crate::status_interval`]).
    pub async fn wal_sender_timeout(&mut self) -> Result<Option<Duration>, Error> {
        let rows = self.simple_query("SHOW wal_sender_timeout").await?;
        match rows.as_slice() {
            [row] => match row.as_slice() {
                [Some(value)] => parse_wal_sender_timeout(value),
                _ => Err(Error::protocol("unexpected SHOW wal_sender_timeout reply")),
            },
            _ => Err(Error::protocol("unexpected SHOW wal_sender_timeout reply")),
        }
    }

    /// The slot's `confirmed_flush_lsn` (`None` when there is no such slot or it has none).
    pub async fn confirmed_flush_lsn(&mut self, slot: &str) -> Result<Option<Lsn>, Error> {
        let sql = format!(
            "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots \
             WHERE slot_name = {}",
            quote_literal(slot)
        );
        let rows = self.simple_query(&sql).await?;
        match rows.first().and_then(|row| row.first()) {
            Some(Some(lsn)) => lsn
                .parse()
                .map(Some)
                .map_err(|e| Error::protocol(format!("bad confirmed_flush_lsn: {e}"))),
            _ => Ok(None),
        }
    }

    /// `CREATE_REPLICATION_SLOT "slot" LOGICAL pgoutput (SNAPSHOT 'export')` (Postgres 15
    /// syntax): creates the slot and exports the snapshot of its consistent point. Returns
    /// the consistent point (where streaming from the slot starts) and the snapshot's name,
    /// which another session imports with `SET TRANSACTION SNAPSHOT` to read exactly what
    /// committed before that point. The snapshot stays valid only while this connection is
    /// open and runs no other command: keep it idle until the snapshot is imported.
    pub async fn create_logical_slot_exporting_snapshot(
        &mut self,
        slot: &str,
        failover: bool,
    ) -> Result<ExportedSlot, Error> {
        // FAILOVER (Postgres 17+): synchronized to standbys; the caller checked the version.
        let command = format!(
            "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput (SNAPSHOT 'export'{})",
            quote_identifier(slot),
            if failover { ", FAILOVER true" } else { "" }
        );
        let rows = self.simple_query(&command).await?;
        let bad = || Error::protocol(format!("unexpected CREATE_REPLICATION_SLOT reply {rows:?}"));
        let [row] = rows.as_slice() else {
            return Err(bad());
        };
        let [_, Some(consistent_point), Some(snapshot), ..] = row.as_slice() else {
            return Err(bad());
        };
        Ok(ExportedSlot {
            consistent_point: consistent_point.parse().map_err(|_| bad())?,
            snapshot: snapshot.clone(),
        })
    }

    /// `START_REPLICATION SLOT "slot" LOGICAL start ("name" 'value', ...)`: waits for the
    /// server's CopyBothResponse and returns the stream. `start` = [`Lsn::ZERO`] streams
    /// from the slot's `confirmed_flush_lsn`; so does any earlier position.
    ///
    /// Options are written as given, quoted: for pgoutput, `("proto_version", "1")` and
    /// `("publication_names", &publication_names(&["outbox"]))`.
    pub async fn start_logical_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<ReplicationStream, Error> {
        let command = start_replication_command(slot, start, options);
        self.send_query(&command).await?;
        loop {
            let frame = self.reader.next_frame("while starting replication").await?;
            match frame.tag {
                wire::COPY_BOTH_RESPONSE => break,
                wire::ERROR_RESPONSE => return Err(wire::error_response(&frame.body, &self.user)),
                wire::NOTICE_RESPONSE => wire::log_notice(&frame.body, &self.target),
                wire::PARAMETER_STATUS => {}
                other => return Err(unexpected(other, "while starting replication")),
            }
        }
        tracing::info!(
            target = %self.target,
            slot = slot,
            start_lsn = %start,
            "logical replication started"
        );
        Ok(ReplicationStream::new(
            self.reader,
            self.writer,
            self.user,
            self.target,
        ))
    }

    /// Sends Terminate and closes the connection.
    pub async fn close(mut self) -> Result<(), Error> {
        frontend::terminate(&mut self.writer.buf);
        self.writer.flush().await?;
        self.writer.shutdown().await
    }
}

/// The START_REPLICATION command text.
pub(crate) fn start_replication_command(
    slot: &str,
    start: Lsn,
    options: &[(&str, &str)],
) -> String {
    let mut command = format!(
        "START_REPLICATION SLOT {} LOGICAL {start}",
        quote_identifier(slot)
    );
    if !options.is_empty() {
        let options: Vec<String> = options
            .iter()
            .map(|(name, value)| format!("{} {}", quote_identifier(name), quote_literal(value)))
            .collect();
        command.push_str(&format!(" ({})", options.join(", ")));
    }
    command
}

/// Runs `connect` within `info`'s connect timeout (if it has one).
pub(crate) async fn with_connect_timeout<T>(
    info: &ConnInfo,
    connect: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match info.connect_timeout() {
        Some(limit) => tokio::time::timeout(limit, connect)
            .await
            .map_err(|_| Error::Timeout {
                what: format!(
                    "connecting to {} (raise connect_timeout if the server is slow to answer)",
                    info.redacted()
                ),
                after: limit,
            })?,
        None => connect.await,
    }
}

/// libpq's host loop, for both connections: tries each of `info`'s hosts in turn
/// ([`ConnInfo::targets`]), each pass of its `target_session_attrs`
/// ([`TargetSessionAttrs::passes`]) over them, each attempt within its own
/// `connect_timeout`. `connect_one` connects to one host and checks it against the pass
/// (`Ok(Err(what it is instead))` rejects it). With one host and `any`, its error is returned
/// as it is; else [`Error::NoServer`] says what each host did.
pub(crate) async fn connect_first<C, F, Fut>(
    info: &ConnInfo,
    mut connect_one: F,
) -> Result<C, Error>
where
    F: FnMut(ConnInfo, TargetSessionAttrs) -> Fut,
    Fut: std::future::Future<Output = Result<Result<C, &'static str>, Error>>,
{
    let wanted = info.target_session_attrs();
    let passes = wanted.passes();
    let targets = info.targets();
    let single = passes.len() == 1 && targets.len() == 1 && wanted == TargetSessionAttrs::Any;
    let mut tried = Vec::new();
    let mut transient = false;
    for &attrs in passes {
        for target in &targets {
            let name = format!("{}:{}", target.host(), target.port());
            match with_connect_timeout(target, connect_one(target.clone(), attrs)).await {
                Ok(Ok(connection)) => return Ok(connection),
                Ok(Err(instead)) => {
                    // A promotion may turn it into what is asked for.
                    transient = true;
                    tracing::debug!(host = %name, target_session_attrs = %attrs, "skipping a server that is {instead}");
                    tried.push(format!("{name} is {instead}"));
                }
                Err(error) if single => return Err(error),
                Err(error) => {
                    transient |= error.is_transient();
                    tracing::debug!(host = %name, error = %error, "cannot use this host; trying the next");
                    tried.push(format!("{name}: {error}"));
                }
            }
        }
    }
    let hosts: Vec<String> = info
        .hosts()
        .iter()
        .map(|(host, port)| format!("{host}:{port}"))
        .collect();
    Err(Error::NoServer {
        hosts: hosts.join(","),
        attrs: wanted,
        tried: tried.join("; "),
        transient,
    })
}

/// Opens the socket and negotiates TLS per `sslmode`.
pub(crate) async fn open(info: &ConnInfo, target: &str) -> Result<(BoxSocket, Transport), Error> {
    let could_not_connect = |error| Error::io(format!("could not connect to {target}"), error);
    if let Some(path) = info.unix_socket_path() {
        // As in libpq, TLS is not used over Unix sockets.
        let socket = UnixStream::connect(&path)
            .await
            .map_err(could_not_connect)?;
        return Ok((Box::new(socket), Transport::Plain));
    }
    // Build the TLS configuration first: its errors are permanent and need no server.
    let config = match info.sslmode() {
        SslMode::Disable => None,
        _ => Some(tls::client_config(info)?),
    };
    let mut tcp = TcpStream::connect((info.host(), info.port()))
        .await
        .map_err(could_not_connect)?;
    tcp.set_nodelay(true).map_err(could_not_connect)?;
    let Some(config) = config else {
        return Ok((Box::new(tcp), Transport::Plain));
    };

    let mut request = BytesMut::new();
    frontend::ssl_request(&mut request);
    tcp.write_all(&request).await.map_err(could_not_connect)?;
    // Exactly one byte, read unbuffered: anything after it belongs to the TLS handshake
    // (CVE-2021-23222).
    let answer = match tcp.read_u8().await {
        Ok(answer) => answer,
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(Error::Closed {
                context: "in answer to the SSLRequest",
            })
        }
        Err(error) => return Err(could_not_connect(error)),
    };
    match answer {
        b'S' => {
            let stream = tls::handshake(config, info.host(), tcp, target).await?;
            let end_point = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|certificates| certificates.first())
                .and_then(|certificate| tls::tls_server_end_point(certificate));
            Ok((Box::new(stream), Transport::Tls { end_point }))
        }
        b'N' if info.sslmode().requires_tls() => Err(Error::TlsUnsupported {
            sslmode: info.sslmode(),
        }),
        b'N' => Ok((Box::new(tcp), Transport::Plain)),
        other => Err(Error::protocol(format!(
            "unexpected answer {:?} to the SSLRequest",
            char::from(other)
        ))),
    }
}

/// SCRAM-SHA-256-PLUS when on TLS, offered, the certificate has a binding hash, and
/// `channel_binding` is not `disable`; otherwise SCRAM-SHA-256 with the GS2 flag libpq would
/// send: `y` ("I could bind, you did not offer") on TLS, `n` ("I cannot bind", or will not)
/// otherwise. (`channel_binding=require` was checked by [`AuthCheck`] before.)
fn choose_sasl(
    mechanisms: &[String],
    transport: &Transport,
    channel_binding: ChannelBinding,
) -> Result<(&'static str, SaslBinding), Error> {
    let offers = |name: &str| mechanisms.iter().any(|m| m == name);
    if channel_binding == ChannelBinding::Disable && offers(SCRAM_SHA_256) {
        return Ok((SCRAM_SHA_256, SaslBinding::unsupported()));
    }
    match transport {
        Transport::Tls {
            end_point: Some(hash),
        } if offers(SCRAM_SHA_256_PLUS) => Ok((
            SCRAM_SHA_256_PLUS,
            SaslBinding::tls_server_end_point(hash.clone()),
        )),
        Transport::Tls { end_point: None } if offers(SCRAM_SHA_256) => {
            Ok((SCRAM_SHA_256, SaslBinding::unsupported()))
        }
        Transport::Tls { .. } if offers(SCRAM_SHA_256) && !offers(SCRAM_SHA_256_PLUS) => {
            Ok((SCRAM_SHA_256, SaslBinding::unrequested()))
        }
        Transport::Plain if offers(SCRAM_SHA_256) => {
            Ok((SCRAM_SHA_256, SaslBinding::unsupported()))
        }
        _ => Err(Error::Auth(format!(
            "the server offers SASL mechanisms {mechanisms:?}, none of which this client \
             implements"
        ))),
    }
}

fn password(info: &ConnInfo) -> Result<&str, Error> {
    info.password()
        .map(|p| p.expose())
        .ok_or_else(|| auth::no_password(info.user()))
}

fn nul_in_password() -> Error {
    Error::Config("the password must not contain a NUL byte".to_owned())
}

fn auth_method_name(code: i32) -> String {
    match code {
        2 => "Kerberos V5 authentication".to_owned(),
        6 => "SCM credential authentication".to_owned(),
        7 | 8 => "GSSAPI authentication".to_owned(),
        9 => "SSPI authentication".to_owned(),
        other => format!("authentication method {other}"),
    }
}

fn unexpected(tag: u8, context: &str) -> Error {
    Error::protocol(format!(
        "unexpected message '{}' {context}",
        char::from(tag).escape_default()
    ))
}

/// Quotes an identifier (slot, publication, table, option name): always in double quotes,
/// with double quotes doubled. Case is preserved. The text must not contain NUL (the server
/// would reject the query).
pub fn quote_identifier(name: &str) -> String {
    quote(name, '"')
}

/// Quotes a string literal: in single quotes, with single quotes doubled. Backslashes stay
/// as they are, which is right for replication commands and for SQL under
/// `standard_conforming_strings=on` (pinned by [`ReplicationConnection::connect`] and
/// [`crate::connect_sql`]). The text must not contain NUL.
pub fn quote_literal(value: &str) -> String {
    quote(value, '\'')
}

/// `text` between two `mark`s, each `mark` in it doubled.
fn quote(text: &str, mark: char) -> String {
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push(mark);
    for c in text.chars() {
        if c == mark {
            quoted.push(mark);
        }
        quoted.push(c);
    }
    quoted.push(mark);
    quoted
}

/// The value of pgoutput's `publication_names` option: the names as quoted identifiers,
/// comma-separated (pgoutput splits it like `SplitIdentifierString`).
pub fn publication_names(names: &[&str]) -> String {
    names
        .iter()
        .map(|name| quote_identifier(name))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        for (name, quoted) in [
            ("slot", "\"slot\""),
            ("MySlot", "\"MySlot\""),
            ("a\"b", "\"a\"\"b\""),
            ("\"", "\"\"\"\""),
            ("", "\"\""),
            ("ünï cødé 🦀", "\"ünï cødé 🦀\""),
            ("it's", "\"it's\""),
        ] {
            assert_eq!(quote_identifier(name), quoted);
        }
    }

    #[test]
    fn literals() {
        for (text, quoted) in [
            ("1", "'1'"),
            ("it's", "'it''s'"),
            ("''", "''''''"),
            ("back\\slash", "'back\\slash'"),
            ("ünï \"q\" 🦀", "'ünï \"q\" 🦀'"),
        ] {
            assert_eq!(quote_literal(text), quoted);
        }
    }

    #[test]
    fn publication_names_are_quoted_identifiers_in_a_literal() {
        assert_eq!(publication_names(&["outbox"]), "\"outbox\"");
        assert_eq!(publication_names(&["a", "B\"c"]), "\"a\",\"B\"\"c\"");
        let command = start_replication_command(
            "relay's \"slot\"",
            "16/B374D848".parse().unwrap(),
            &[
                ("proto_version", "1"),
                ("publication_names", &publication_names(&["pub", "it's"])),
            ],
        );
        assert_eq!(
            command,
            "START_REPLICATION SLOT \"relay's \"\"slot\"\"\" LOGICAL 16/B374D848 \
             (\"proto_version\" '1', \"publication_names\" '\"pub\",\"it''s\"')"
        );
        assert_eq!(
            start_replication_command("s", Lsn::ZERO, &[]),
            "START_REPLICATION SLOT \"s\" LOGICAL 0/0"
        );
    }

    /// A scripted server on the other end of a pipe: checks what the client sends and
    /// answers with canned messages.
    mod fake {
        use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

        pub(super) fn message(tag: u8, body: &[u8]) -> Vec<u8> {
            let mut out = vec![tag];
            out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            out.extend_from_slice(body);
            out
        }

        pub(super) fn auth(code: i32, extra: &[u8]) -> Vec<u8> {
            let mut body = code.to_be_bytes().to_vec();
            body.extend_from_slice(extra);
            message(b'R', &body)
        }

        pub(super) fn parameter(name: &str, value: &str) -> Vec<u8> {
            message(b'S', format!("{name}\0{value}\0").as_bytes())
        }

        pub(super) fn ready() -> Vec<u8> {
            message(b'Z', b"I")
        }

        /// The startup packet's parameters.
        pub(super) async fn read_startup(server: &mut DuplexStream) -> Vec<(String, String)> {
            let length = server.read_u32().await.unwrap() as usize;
            let mut body = vec![0; length - 4];
            server.read_exact(&mut body).await.unwrap();
            assert_eq!(&body[..4], &196_608u32.to_be_bytes(), "protocol 3.0");
            let text = String::from_utf8(body[4..].to_vec()).unwrap();
            let words: Vec<&str> = text.split('\0').filter(|w| !w.is_empty()).collect();
            words
                .chunks(2)
                .map(|pair| (pair[0].to_owned(), pair[1].to_owned()))
                .collect()
        }

        /// One tagged message from the client.
        pub(super) async fn read_message(server: &mut DuplexStream) -> (u8, Vec<u8>) {
            let tag = server.read_u8().await.unwrap();
            let length = server.read_u32().await.unwrap() as usize;
            let mut body = vec![0; length - 4];
            server.read_exact(&mut body).await.unwrap();
            (tag, body)
        }

        pub(super) async fn send(server: &mut DuplexStream, parts: &[Vec<u8>]) {
            server.write_all(&parts.concat()).await.unwrap();
        }

        pub(super) fn good_settings() -> Vec<Vec<u8>> {
            vec![
                parameter("client_encoding", "UTF8"),
                parameter("DateStyle", "ISO, MDY"),
                parameter("TimeZone", "UTC"),
                parameter("standard_conforming_strings", "on"),
                parameter("server_version", "15.4 (Debian 15.4-1)"),
            ]
        }
    }

    async fn session_with(
        info: &str,
        script: impl FnOnce(tokio::io::DuplexStream) -> tokio::task::JoinHandle<()>,
    ) -> Result<ReplicationConnection, Error> {
        let info = ConnInfo::parse_with_env(info, |_| None).unwrap();
        let (client, server) = tokio::io::duplex(1 << 16);
        let server = script(server);
        let result = ReplicationConnection::start_session(
            Box::new(client),
            Transport::Plain,
            &info,
            info.redacted(),
        )
        .await;
        server.await.unwrap();
        result
    }

    #[tokio::test]
    async fn startup_pins_settings_and_answers_cleartext_password() {
        let connection = session_with(
            "user=relay password=pw dbname=app application_name=r",
            |mut server| {
                tokio::spawn(async move {
                    let parameters = fake::read_startup(&mut server).await;
                    for expected in [
                        ("user", "relay"),
                        ("database", "app"),
                        ("replication", "database"),
                        ("client_encoding", "UTF8"),
                        ("DateStyle", "ISO"),
                        ("TimeZone", "UTC"),
                        ("standard_conforming_strings", "on"),
                        ("application_name", "r"),
                    ] {
                        assert!(
                            parameters.contains(&(expected.0.to_owned(), expected.1.to_owned())),
                            "{expected:?} missing from {parameters:?}"
                        );
                    }
                    fake::send(&mut server, &[fake::auth(3, b"")]).await;
                    assert_eq!(
                        fake::read_message(&mut server).await,
                        (b'p', b"pw\0".to_vec())
                    );
                    let mut reply = vec![fake::auth(0, b"")];
                    reply.extend(fake::good_settings());
                    reply.push(fake::message(b'K', &[0, 0, 0, 42, 0, 0, 0, 7]));
                    reply.push(fake::ready());
                    fake::send(&mut server, &reply).await;
                })
            },
        )
        .await
        .unwrap();
        assert_eq!(connection.backend_pid(), Some(42));
        assert_eq!(connection.server_version_num(), Some(150_004));
        assert_eq!(connection.parameter("DateStyle"), Some("ISO, MDY"));
    }

    #[tokio::test]
    async fn a_setting_that_did_not_stick_is_a_permanent_error() {
        let error = session_with("user=relay", |mut server| {
            tokio::spawn(async move {
                fake::read_startup(&mut server).await;
                let mut reply = vec![fake::auth(0, b"")];
                reply.extend(fake::good_settings());
                reply.push(fake::parameter("TimeZone", "Europe/Berlin"));
                reply.push(fake::ready());
                fake::send(&mut server, &reply).await;
            })
        })
        .await
        .unwrap_err();
        assert!(
            matches!(
                error,
                Error::Setting {
                    parameter: "TimeZone",
                    ..
                }
            ),
            "{error}"
        );
        assert!(!error.is_transient());
    }

    /// The error of a session whose server asks for authentication `code` (with `extra`).
    async fn auth_refused(info: &str, code: i32, extra: &'static [u8]) -> Error {
        session_with(info, |mut server| {
            tokio::spawn(async move {
                fake::read_startup(&mut server).await;
                fake::send(&mut server, &[fake::auth(code, extra)]).await;
            })
        })
        .await
        .unwrap_err()
    }

    #[tokio::test]
    async fn unsupported_or_impossible_authentication_is_permanent() {
        let error = auth_refused("user=relay password=pw", 7, b"").await;
        assert!(matches!(error, Error::Auth(_)), "{error}");
        assert!(error.to_string().contains("GSSAPI"), "{error}");
        assert!(!error.is_transient());

        let error = auth_refused("user=relay", 5, &[1, 2, 3, 4]).await;
        assert!(error.to_string().contains("none was given"), "{error}");
        assert!(!error.is_transient());

        let error = auth_refused("user=relay password=pw", 10, b"OAUTHBEARER\0\0").await;
        assert!(error.to_string().contains("OAUTHBEARER"), "{error}");
    }

    #[tokio::test]
    async fn md5_answer_and_server_errors_during_startup() {
        let error = session_with("user=relay password=pw", |mut server| {
            tokio::spawn(async move {
                fake::read_startup(&mut server).await;
                fake::send(&mut server, &[fake::auth(5, &[1, 2, 3, 4])]).await;
                let (tag, body) = fake::read_message(&mut server).await;
                assert_eq!(tag, b'p');
                let expected =
                    postgres_protocol::authentication::md5_hash(b"relay", b"pw", [1, 2, 3, 4]);
                assert_eq!(body, [expected.as_bytes(), b"\0"].concat());
                let error = fake::message(
                    b'E',
                    b"SFATAL\0VFATAL\0C57P03\0Mthe database system is starting up\0\0",
                );
                fake::send(&mut server, &[error]).await;
            })
        })
        .await
        .unwrap_err();
        assert_eq!(error.sqlstate(), Some("57P03"));
        assert!(error.is_transient());
    }

    #[test]
    fn sasl_choice() {
        let both = vec![SCRAM_SHA_256_PLUS.to_owned(), SCRAM_SHA_256.to_owned()];
        let plain_only = vec![SCRAM_SHA_256.to_owned()];
        let bound = Transport::Tls {
            end_point: Some(vec![1; 32]),
        };
        let unbound = Transport::Tls { end_point: None };
        let pick = |m: &[String], t: &Transport| {
            choose_sasl(m, t, ChannelBinding::Prefer)
                .map(|(name, _)| name)
                .ok()
        };
        assert_eq!(pick(&both, &bound), Some(SCRAM_SHA_256_PLUS));
        assert_eq!(pick(&both, &unbound), Some(SCRAM_SHA_256));
        assert_eq!(pick(&plain_only, &bound), Some(SCRAM_SHA_256));
        assert_eq!(pick(&plain_only, &Transport::Plain), Some(SCRAM_SHA_256));
        assert_eq!(pick(&["OAUTHBEARER".to_owned()], &Transport::Plain), None);
        let disabled = choose_sasl(&both, &bound, ChannelBinding::Disable).map(|(name, _)| name);
        assert_eq!(
            disabled.ok(),
            Some(SCRAM_SHA_256),
            "channel_binding=disable never binds"
        );
    }
}
