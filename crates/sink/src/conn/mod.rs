//! The sink's own publishing connection to NATS: one per session, speaking the client
//! protocol with [`crate::wire`], so that a publish is a frame the sink writes itself (its
//! `Nats-*` headers first, no header map per message) and an ack is read where it lands.
//!
//! async-nats keeps everything else (stream management, the fence's tail, a duplicate's
//! original, health): its API offers no way to write a pre-serialised frame
//! (docs/performance.md, proposal 5), so this is the smallest client that publishes with
//! every connection feature the relay's users configure.
//!
//! ```text
//!  publisher ──frames (Bytes)──► writer task ──► socket ──► nats-server
//!                                    ▲ PONG                    │
//!  acker ◄──(sequence, answer)── reader task ◄────────────────┘  MSG {inbox}.{n} (sid 1)
//! ```
//!
//! # Invariants
//! - CN1 Every authentication and TLS mode of the relay's configuration works here as with
//!   async-nats: user and password, token, nkey, user JWT (a `.creds` file), TLS with a CA
//!   file or the system's roots, a client certificate, TLS upgraded after `INFO` (when the
//!   URL says `tls://`, the options ask for it or the server requires it) or first
//!   (`tls_first`). The `CONNECT` is async-nats's own [`async_nats::ConnectInfo`].
//! - CN2 A connection is used only once the server answered `CONNECT` and `PING` with
//!   `PONG`, and the session's one subscription (`SUB {inbox}.> 1`: fast-ingest batches
//!   answer on subjects of several tokens, `crate::batch` F5) is written before any publish,
//!   on the same ordered stream, so the server knows it before it answers.
//! - CN3 Nothing a session writes survives it: the connection is not re-established (no
//!   publish is ever re-sent by this module); when it fails, the acker learns why
//!   ([`Answer::Closed`], or the writer's channel closing) and the session ends (P3), and
//!   the next session opens a new connection and re-syncs from the stream (P5, P6). The
//!   acker reads the connection while it awaits no answer too, so an idle session ends when
//!   its connection closes, not at its next publish (`SinkError::Disconnected`).
//! - CN4 The server's `PING`s are answered, so an idle session stays connected; `-ERR` and
//!   anything that is not the protocol close the connection and end the session with the
//!   server's words, rather than a silent ack timeout. The connection sends a `PING` of its
//!   own every [`Connector::ping_interval`]; when [`PINGS_UNANSWERED`] went unanswered, the
//!   server is gone without a word (a half-open connection) and the session ends with that.
//! - CN5 Memory is bounded: answers wait in a channel of the window's size (P2) and frames
//!   in a channel of [`WRITE_QUEUE`] chunks; the read buffer holds at most one operation
//!   beyond what was read (the server's answers are small; `max_payload` bounds them).
//! - CN6 Every `INFO` is applied, in the handshake and in the session: the one that follows
//!   `CONNECT` carries the account's own `max_payload` (config-file accounts, operator/JWT
//!   accounts, hosted NATS), and the session's [`Connection::max_payload`] is the lowest
//!   the server announced, so the publisher checks events against it (P7). An in-session
//!   `INFO` that lowers it further ends the session (the next one checks against it); one
//!   with `ldm: true` (lame-duck mode) sets [`Connection::lame_duck`]: the publisher stops
//!   taking events, what is in flight is acknowledged, and the session ends with
//!   [`crate::error::SinkError::LameDuck`], not a failure; the next session dials that server last.
//!   `connect_urls` join the candidates of later sessions ([`Learned`]), with the scheme
//!   and, for an IP address, the TLS name of the configured servers.
//! - CN7 `-ERR` is read as nats-server means it (and nats.go reads it): `Permissions
//!   Violation for Publish to <subject>` leaves the connection open, drops that publish
//!   only, and reaches the acker as [`Answer::Denied`] behind every answer read before it
//!   (P11); any other `-ERR` closes the connection and ends the session with the server's
//!   words. In the handshake, a refused credential (`Authorization Violation`,
//!   `Authentication Timeout`, expired or revoked user or account) and a server without
//!   headers are permanent ([`crate::error::SinkError::Refused`]); in a session they end it (the
//!   next handshake decides: a rotated `.creds` file is read again).
//! - CN8 The handshake reads on past the subscription's `PONG` only what arrived with it:
//!   those bytes (a `PING`, an `INFO`) are the reader's first, not an error. The server's
//!   `PING`s are answered by the writer ahead of any queued publish. `CONNECT` says
//!   `tls_required: true` whenever the connection is TLS.
//! - CN9 Servers are dialled in a random order per session unless [`Connector::randomize`] is
//!   off (`--no-randomize`, the `nats` CLI's and async-nats's name), each address a name
//!   resolves to with its own [`Connector::timeout`]; each failed address is logged with its
//!   reason, and all of them are in the error when none connected.
//!
//! Inside: `open.rs` opens a connection (dial, TLS, INFO, CONNECT), `read.rs` is the reader
//! task; the connection, its writer and the answers' types are here.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::context::PublishError;
use bytes::{Buf, Bytes, BytesMut};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};
use tokio_util::task::AbortOnDropHandle;
use tracing::{info, warn};

use crate::ack::{self, PubAck};
use crate::wire::{self, Parsed, ServerOp};

mod open;
mod read;
pub use open::*;
use read::*;

/// Chunks of frames the writer task may have queued (each is one batch of publishes).
pub(crate) const WRITE_QUEUE: usize = 64;

/// How often a connection `PING`s the server by default: async-nats's default (CN4).
pub const PING_INTERVAL: Duration = Duration::from_secs(60);

/// `PING`s the connection may have sent unanswered; one more interval and it is closed (CN4).
pub const PINGS_UNANSWERED: u32 = 2;

/// The subscription id of the session's answers.
const SID: u64 = 1;

/// The longest control line the server sends us that we accept (its `INFO` grows with the
/// cluster's URLs).
const MAX_INFO_LINE: usize = 1 << 20;

/// A credential the publishing connection presents (CN1).
#[derive(Clone)]
pub enum Auth {
    /// No credential.
    None,
    /// `user` and `pass`.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// `auth_token`.
    Token(String),
    /// A user nkey seed: the server's nonce is signed with it.
    Nkey(String),
    /// A user JWT and the seed that signs the nonce (a `.creds` file).
    Jwt {
        /// The user JWT.
        jwt: String,
        /// The user nkey seed.
        seed: String,
    },
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Secrets never print.
        f.write_str(match self {
            Auth::None => "None",
            Auth::UserPassword { .. } => "UserPassword(<redacted>)",
            Auth::Token(_) => "Token(<redacted>)",
            Auth::Nkey(_) => "Nkey(<redacted>)",
            Auth::Jwt { .. } => "Jwt(<redacted>)",
        })
    }
}

/// What the publishing connections learned of the servers, kept from one session to the
/// next (CN6): the `connect_urls` the servers advertise, and the server that last announced
/// lame-duck mode.
#[derive(Debug, Default)]
pub struct Learned {
    /// `host:port` of every server the cluster advertised.
    connect_urls: Vec<String>,
    /// `host:port` of the server that went into lame-duck mode, dialled last.
    lame_duck: Option<String>,
}

/// Where and how the sink opens its publishing connection (CN1).
#[derive(Debug, Clone)]
pub struct Connector {
    /// Server URLs (`nats://host:port`, `tls://host:port` or `host[:port]`).
    pub servers: Vec<String>,
    /// The credential.
    pub auth: Auth,
    /// The TLS configuration (CA, client certificate), when the relay's options give one;
    /// otherwise the system's roots are used if TLS is needed.
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// Upgrade to TLS even when the server does not require it.
    pub tls_required: bool,
    /// TLS before the server's `INFO`.
    pub tls_first: bool,
    /// The connection's name in the server's monitoring.
    pub name: String,
    /// How long connecting to one address, and the handshake after it, may take (CN9).
    pub timeout: Duration,
    /// How often the connection `PING`s the server (CN4).
    pub ping_interval: Duration,
    /// Dial the servers in a random order per session (CN9); `false`: in the order given.
    pub randomize: bool,
    /// What earlier connections learned (CN6), shared by the connectors of one relay.
    pub learned: Arc<Mutex<Learned>>,
}

impl Connector {
    /// A plain connection to `url` without credential (tests, local servers).
    pub fn plain(url: impl Into<String>) -> Connector {
        Connector {
            servers: vec![url.into()],
            auth: Auth::None,
            tls: None,
            tls_required: false,
            tls_first: false,
            name: "outbox-relay-publisher".into(),
            timeout: Duration::from_secs(5),
            ping_interval: PING_INTERVAL,
            randomize: true,
            learned: Arc::default(),
        }
    }

    /// Opens a session's publishing connection: to the first server that accepts us,
    /// subscribed to `{inbox}.>` (CN2), `inbox` a fresh inbox of `client` (under its inbox
    /// prefix). `window` is the session's window: the capacity of the answers' channel (CN5).
    /// Opened before the session says it streams, so a session that streams can publish.
    pub async fn open(
        &self,
        client: &async_nats::Client,
        window: usize,
    ) -> Result<Connection, crate::error::SinkError> {
        let mut reply_prefix = client.new_inbox();
        reply_prefix.push('.');
        self.open_with(reply_prefix, window).await
    }

    /// [`Connector::open`] with the replies under `reply_prefix`.
    async fn open_with(
        &self,
        reply_prefix: String,
        window: usize,
    ) -> Result<Connection, crate::error::SinkError> {
        let mut failures = Vec::new();
        let candidates = self
            .candidates()
            .map_err(crate::error::SinkError::Connect)?;
        for address in &candidates {
            match self.open_one(address, &reply_prefix).await {
                Ok((stream, info, leftover)) => {
                    let where_ = address.to_string();
                    if self.learned().lame_duck.as_deref() == Some(where_.as_str()) {
                        // It is the only one left: lame-duck mode has ended (or will).
                        self.learned().lame_duck = None;
                    }
                    return Ok(Connection::start(
                        Opened {
                            stream,
                            info,
                            leftover,
                            server: where_,
                        },
                        reply_prefix,
                        window,
                        self.ping_interval,
                        self.learned.clone(),
                    ));
                }
                Err(Failure::Other(why)) => failures.push(format!("{address}: {why}")),
                Err(Failure::Subscription(why)) => {
                    return Err(crate::error::SinkError::SubscriptionRefused {
                        subject: format!("{reply_prefix}>"),
                        why,
                    });
                }
                Err(Failure::Refused(kind, why)) => {
                    return Err(crate::error::SinkError::Refused {
                        kind,
                        why: format!("{address}: {why}"),
                    });
                }
            }
        }
        Err(crate::error::SinkError::Connect(if failures.is_empty() {
            "no NATS server is configured".to_owned()
        } else {
            failures.join("; ")
        }))
    }

    fn learned(&self) -> std::sync::MutexGuard<'_, Learned> {
        self.learned.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The servers this session dials, in order (CN6, CN9): the configured ones and those
    /// the cluster advertised, shuffled unless [`Connector::randomize`] is off, the one in
    /// lame-duck mode last.
    fn candidates(&self) -> Result<Vec<Address>, String> {
        let configured = self
            .servers
            .iter()
            .map(|server| {
                Address::parse(server).map_err(|why| format!("{}: {why}", redact(server)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let learned = self.learned();
        let mut candidates = configured.clone();
        if let Some(first) = configured.first() {
            for url in &learned.connect_urls {
                let Ok(mut address) = Address::parse(url) else {
                    continue;
                };
                if candidates.iter().any(|known| known.same_server(&address)) {
                    continue;
                }
                // The configured servers' scheme, and their TLS name for an IP address
                // (a certificate names the host the operator configured).
                address.tls = first.tls;
                if address.host.parse::<std::net::IpAddr>().is_ok()
                    && first.host.parse::<std::net::IpAddr>().is_err()
                {
                    address.tls_name = Some(first.host.clone());
                }
                candidates.push(address);
            }
        }
        if self.randomize {
            use rand::seq::SliceRandom as _;
            candidates.shuffle(&mut rand::rng());
        }
        if let Some(lame) = &learned.lame_duck {
            // A stable sort: the others keep their (shuffled) order.
            candidates.sort_by_key(|address| address.to_string() == *lame);
        }
        Ok(candidates)
    }

    async fn open_one(
        &self,
        address: &Address,
        reply_prefix: &str,
    ) -> Result<(Stream, Info, BytesMut), Failure> {
        let tcp = dial(&address.host, address.port, self.timeout).await?;
        tokio::time::timeout(self.timeout, self.handshake(tcp, address, reply_prefix))
            .await
            .unwrap_or_else(|_| {
                Err(Failure::Other(format!(
                    "no answer within {:?}",
                    self.timeout
                )))
            })
    }

    async fn handshake(
        &self,
        tcp: TcpStream,
        address: &Address,
        reply_prefix: &str,
    ) -> Result<(Stream, Info, BytesMut), Failure> {
        tcp.set_nodelay(true)
            .map_err(|e| format!("cannot set TCP_NODELAY: {e}"))?;
        let mut stream: Stream = Box::new(tcp);
        let mut buffer = BytesMut::with_capacity(4096);
        let tls_name = address.tls_name.as_deref().unwrap_or(&address.host);
        if self.tls_first {
            stream = self.tls(stream, tls_name).await?;
        }
        let mut info = first_info(&mut stream, &mut buffer).await?;
        let tls = self.tls_first || self.tls_required || address.tls || info.tls_required;
        if !self.tls_first && tls {
            stream = self.tls(stream, tls_name).await?;
        }
        let connect = self.connect_json(&info, tls)?;
        hello(&mut stream, &mut buffer, &mut info, &connect).await?;
        subscribe(&mut stream, &mut buffer, &mut info, reply_prefix).await?;
        // CN8: whatever came with the PONG is the reader's.
        Ok((stream, info, buffer))
    }

    async fn tls(&self, stream: Stream, host: &str) -> Result<Stream, String> {
        let config = match &self.tls {
            Some(config) => config.clone(),
            None => system_tls()?,
        };
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| format!("{host:?} is not a name TLS can verify: {e}"))?;
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, stream)
            .await
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
        Ok(Box::new(tls))
    }

    fn connect_json(&self, info: &Info, tls: bool) -> Result<String, String> {
        let mut connect = async_nats::ConnectInfo {
            verbose: false,
            pedantic: false,
            user_jwt: None,
            nkey: None,
            signature: None,
            name: Some(self.name.clone()),
            echo: false,
            lang: "rust".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            protocol: async_nats::Protocol::Dynamic,
            tls_required: tls,
            user: None,
            pass: None,
            auth_token: None,
            headers: true,
            no_responders: true,
        };
        let sign = |seed: &str| {
            let key = nkeys::KeyPair::from_seed(seed).map_err(|_| "the nkey seed is not valid")?;
            let signature = key
                .sign(info.nonce.as_bytes())
                .map_err(|_| "cannot sign the server's nonce")?;
            use base64::Engine as _;
            Ok::<_, String>((
                key.public_key(),
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(signature),
            ))
        };
        match &self.auth {
            Auth::None => {}
            Auth::UserPassword { user, password } => {
                connect.user = Some(user.clone());
                connect.pass = Some(password.clone());
            }
            Auth::Token(token) => connect.auth_token = Some(token.clone()),
            Auth::Nkey(seed) => {
                let (public, signature) = sign(seed)?;
                connect.nkey = Some(public);
                connect.signature = Some(signature);
            }
            Auth::Jwt { jwt, seed } => {
                let (_, signature) = sign(seed)?;
                connect.user_jwt = Some(jwt.clone());
                connect.signature = Some(signature);
            }
        }
        serde_json::to_string(&connect).map_err(|e| format!("cannot write CONNECT: {e}"))
    }
}

/// What an `-ERR` means (CN7), as nats-server sends it and nats.go reads it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ServerError<'a> {
    /// `Permissions Violation for Publish to "<subject>"`: that publish is dropped, the
    /// connection stays open.
    PublishDenied(&'a str),
    /// The credential is refused, timed out, expired or revoked.
    Authentication,
    /// Anything else (`Stale Connection`, `Slow Consumer`, `Maximum Payload Violation`, a
    /// parser error...): the server closes the connection.
    Closing,
}

/// Reads an `-ERR`'s text (CN7).
pub(crate) fn classify(text: &str) -> ServerError<'_> {
    const DENIED: &str = "permissions violation for publish to ";
    if let Some(prefix) = text.get(..DENIED.len()) {
        if prefix.eq_ignore_ascii_case(DENIED) {
            let subject = text.get(DENIED.len()..).unwrap_or_default().trim();
            let subject = subject
                .strip_prefix('"')
                .and_then(|s| s.strip_suffix('"'))
                .unwrap_or(subject);
            return ServerError::PublishDenied(subject);
        }
    }
    let lower = text.to_ascii_lowercase();
    if lower.starts_with("authorization violation")
        || lower.starts_with("authentication timeout")
        || lower.contains("authentication expired")
        || lower.contains("authentication revoked")
    {
        return ServerError::Authentication;
    }
    ServerError::Closing
}

/// Reads until the server's `PONG` (`Ok(Ok)`) or its `-ERR` (`Ok(Err)`, its words),
/// applying every `INFO` on the way to `info` (CN6).
async fn pong(
    stream: &mut Stream,
    buffer: &mut BytesMut,
    info: &mut Info,
) -> Result<Result<(), String>, String> {
    loop {
        let mut update = None;
        let answer = read_op(stream, buffer, |op| match op {
            ServerOp::Pong => Some(Ok(())),
            ServerOp::Err(text) => Some(Err(String::from_utf8_lossy(text).into_owned())),
            ServerOp::Info(json) => {
                update = Some(json.to_vec());
                None
            }
            _ => None,
        })
        .await?;
        if let Some(json) = update {
            info.update(&json)?;
        }
        if let Some(answer) = answer {
            return Ok(answer);
        }
    }
}

/// Reads until one operation is whole and hands it to `take`; `PING` is answered on the way
/// (a server may ping before we are done). `Ok(None)`: an operation `take` did not want.
async fn read_op<T>(
    stream: &mut Stream,
    buffer: &mut BytesMut,
    mut take: impl FnMut(ServerOp<'_>) -> Option<T>,
) -> Result<Option<T>, String> {
    loop {
        match wire::parse(buffer, MAX_INFO_LINE, MAX_INFO_LINE) {
            Parsed::Op(op, used) => {
                let ping = op == ServerOp::Ping;
                let taken = take(op);
                buffer.advance(used);
                if ping {
                    stream
                        .write_all(b"PONG\r\n")
                        .await
                        .map_err(|e| format!("cannot answer PING: {e}"))?;
                }
                return Ok(taken);
            }
            Parsed::Incomplete => {}
            Parsed::Invalid(why) => return Err(format!("the server does not speak NATS: {why}")),
        }
        if stream
            .read_buf(buffer)
            .await
            .map_err(|e| format!("cannot read: {e}"))?
            == 0
        {
            return Err("the server closed the connection".into());
        }
    }
}

/// What the reader task hands the acker.
#[derive(Debug)]
pub(crate) enum Answer {
    /// The answer to the session's publish number `sequence`, read (AK1–AK3).
    Ack {
        sequence: u64,
        ack: Result<Acked, PublishError>,
    },
    /// The server dropped a publish to `subject`, which the user may not publish to, and
    /// said so in `why` (CN7, P11).
    Denied { subject: String, why: String },
    /// The server went into lame-duck mode (CN6).
    LameDuck,
    /// The connection is gone: why (CN3, CN4).
    Closed(String),
}

/// A positive ack, owned.
#[derive(Debug)]
pub(crate) struct Acked {
    pub(crate) duplicate: bool,
    /// The stream and sequence of the message stored (P8 reads the original of a duplicate).
    pub(crate) stream: String,
    pub(crate) sequence: u64,
}

impl From<PubAck<'_>> for Acked {
    fn from(ack: PubAck<'_>) -> Self {
        Acked {
            duplicate: ack.duplicate,
            stream: if ack.duplicate {
                ack.stream.to_string()
            } else {
                String::new()
            },
            sequence: ack.sequence,
        }
    }
}

/// A handshake's result.
struct Opened {
    stream: Stream,
    info: Info,
    /// What arrived after the subscription's `PONG` (CN8).
    leftover: BytesMut,
    /// `host:port`.
    server: String,
}

/// An open publishing connection ([`Connector::open`]), for one session of
/// [`crate::run`]: its writer's queue, its answers, what the server announced, the prefix
/// of its reply subjects and its tasks.
#[derive(Debug)]
pub struct Connection {
    pub(crate) frames: mpsc::Sender<Bytes>,
    pub(crate) answers: mpsc::Receiver<Answer>,
    /// The lowest `max_payload` the server announced (CN6); 0: none.
    pub(crate) max_payload: usize,
    /// Set when the server announced lame-duck mode (CN6).
    pub(crate) lame_duck: Arc<AtomicBool>,
    /// `host:port` of the server.
    pub(crate) server: String,
    /// `{inbox}.`: publish number `n` asks for its answer on `{inbox}.{n}` (P10).
    pub(crate) reply_prefix: String,
    /// The writer and reader tasks, aborted when dropped.
    pub(crate) tasks: (AbortOnDropHandle<()>, AbortOnDropHandle<()>),
}

impl Connection {
    /// The server this connection is to (`host:port`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The lowest `max_payload` the server announced to this connection (CN6); 0 when it
    /// announced none.
    pub fn max_payload(&self) -> usize {
        self.max_payload
    }

    fn start(
        opened: Opened,
        reply_prefix: String,
        answers: usize,
        ping_interval: Duration,
        learned: Arc<Mutex<Learned>>,
    ) -> Connection {
        let Opened {
            stream,
            info,
            leftover,
            server,
        } = opened;
        if let Some(urls) = &info.connect_urls {
            learned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .connect_urls
                .clone_from(urls);
        }
        let (read, write) = tokio::io::split(stream);
        let (frames_tx, frames_rx) = mpsc::channel(WRITE_QUEUE);
        let (answers_tx, answers_rx) = mpsc::channel(answers.max(1) + 16);
        let unanswered = Arc::new(AtomicU32::new(0));
        let pongs = Arc::new(Pongs::default());
        let lame_duck = Arc::new(AtomicBool::new(false));
        let writer = AbortOnDropHandle::new(tokio::spawn(write_frames(
            write,
            frames_rx,
            answers_tx.clone(),
            (ping_interval, unanswered.clone()),
            pongs.clone(),
        )));
        let reader = AbortOnDropHandle::new(tokio::spawn(read_answers(Reader {
            read,
            buffer: leftover,
            answers: answers_tx,
            reply_prefix: reply_prefix.clone(),
            info: info.clone(),
            unanswered,
            pongs,
            lame_duck: lame_duck.clone(),
            learned,
            server: server.clone(),
        })));
        Connection {
            frames: frames_tx,
            answers: answers_rx,
            max_payload: info.max_payload,
            lame_duck,
            server,
            reply_prefix,
            tasks: (writer, reader),
        }
    }
}

/// The `PONG`s the writer owes the server (CN8): they go out ahead of queued publishes.
#[derive(Debug, Default)]
struct Pongs {
    owed: AtomicU32,
    notify: Notify,
}

/// The writer task: writes each queued chunk, and whatever else is queued behind it, then
/// flushes (TLS buffers records); `PONG`s first (CN8); `PING`s every `ping.0`, counting in
/// `ping.1` the ones the reader has not seen answered, and closes the connection when too
/// many were not (CN4).
async fn write_frames(
    mut write: tokio::io::WriteHalf<Stream>,
    mut frames: mpsc::Receiver<Bytes>,
    answers: mpsc::Sender<Answer>,
    ping: (Duration, Arc<AtomicU32>),
    pongs: Arc<Pongs>,
) {
    let (interval, unanswered) = ping;
    let mut pings = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = async {
        loop {
            tokio::select! {
                biased;
                () = pongs.notify.notified() => {
                    for _ in 0..pongs.owed.swap(0, Ordering::Relaxed) {
                        write.write_all(b"PONG\r\n").await?;
                    }
                }
                chunk = frames.recv() => {
                    let Some(chunk) = chunk else { return Ok(None) };
                    write.write_all(&chunk).await?;
                    while let Ok(chunk) = frames.try_recv() {
                        write.write_all(&chunk).await?;
                    }
                }
                _ = pings.tick() => {
                    if unanswered.fetch_add(1, Ordering::Relaxed) >= PINGS_UNANSWERED {
                        return Ok(Some(format!(
                            "the NATS server answered none of the last {PINGS_UNANSWERED} PINGs, sent {interval:?} apart"
                        )));
                    }
                    write.write_all(b"PING\r\n").await?;
                }
            }
            write.flush().await?;
        }
    };
    let why = match result.await {
        Ok(None) => return,
        Ok(Some(why)) => why,
        Err::<_, std::io::Error>(error) => format!("cannot write to NATS: {error}"),
    };
    let _ = answers.send(Answer::Closed(why)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_taken_apart() {
        let a = |s| Address::parse(s);
        assert_eq!(
            a("nats://127.0.0.1:4333").unwrap(),
            Address {
                host: "127.0.0.1".into(),
                port: 4333,
                tls: false,
                tls_name: None,
            }
        );
        assert_eq!(
            a("tls://nats.example.com").unwrap(),
            Address {
                host: "nats.example.com".into(),
                port: 4222,
                tls: true,
                tls_name: None,
            }
        );
        assert_eq!(
            a("localhost:5").unwrap(),
            Address {
                host: "localhost".into(),
                port: 5,
                tls: false,
                tls_name: None,
            }
        );
        assert_eq!(
            a("nats://[::1]:4222").unwrap(),
            Address {
                host: "::1".into(),
                port: 4222,
                tls: false,
                tls_name: None,
            }
        );
        assert!(a("ws://h:1").unwrap_err().contains("ws://"));
        assert!(a("nats://h:x").is_err());
        assert!(a("nats://:4222").is_err());
    }

    #[test]
    fn redaction_drops_user_information() {
        assert_eq!(redact("nats://u:p@h:1"), "nats://h:1");
        assert_eq!(redact("t@h:1"), "h:1");
        assert_eq!(redact("nats://h:1"), "nats://h:1");
    }

    #[test]
    fn secrets_never_print() {
        let auth = Auth::UserPassword {
            user: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{auth:?}").contains("hunter2"));
        assert!(!format!("{:?}", Auth::Token("t0ken".into())).contains("t0ken"));
    }

    #[test]
    fn errors_are_classified_as_nats_server_means_them() {
        assert_eq!(
            classify("Permissions Violation for Publish to \"orders.x\""),
            ServerError::PublishDenied("orders.x")
        );
        assert_eq!(
            classify("permissions violation for publish to orders.y"),
            ServerError::PublishDenied("orders.y")
        );
        for auth in [
            "Authorization Violation",
            "Authentication Timeout",
            "User Authentication Expired",
            "User Authentication Revoked",
            "Account Authentication Expired",
        ] {
            assert_eq!(classify(auth), ServerError::Authentication, "{auth}");
        }
        for closing in [
            "Stale Connection",
            "Slow Consumer",
            "Maximum Payload Violation",
            "Permissions Violation for Subscription to \"x\"",
            "Unknown Protocol Operation",
            "",
        ] {
            assert_eq!(classify(closing), ServerError::Closing, "{closing}");
        }
    }

    #[test]
    fn infos_are_applied_and_max_payload_only_goes_down() {
        let mut info =
            Info::parse(br#"{"max_payload":1048576,"headers":true,"nonce":"n"}"#).unwrap();
        assert_eq!(
            (info.max_payload, info.headers, info.ldm),
            (1_048_576, true, false)
        );
        info.update(br#"{"max_payload":4096,"connect_urls":["10.0.0.2:4222"]}"#)
            .unwrap();
        assert_eq!(info.max_payload, 4096);
        assert_eq!(info.nonce, "n", "what an update omits is kept");
        assert_eq!(
            info.connect_urls.as_deref(),
            Some(&["10.0.0.2:4222".to_owned()][..])
        );
        info.update(br#"{"max_payload":1048576,"ldm":true}"#)
            .unwrap();
        assert_eq!(info.max_payload, 4096, "the account's limit stays");
        assert!(info.ldm);
        assert!(info.update(b"{nope").is_err());
        let none = Info::parse(b"{}").unwrap();
        assert!(!none.headers, "a server that does not say has no headers");
    }

    fn connector(port: u16) -> Connector {
        let mut connector = Connector::plain(format!("nats://127.0.0.1:{port}"));
        connector.timeout = Duration::from_secs(5);
        connector
    }

    /// A scripted server, for what a real one cannot be made to do on cue (two operations
    /// in one read): each `(expect, answer)` reads until the client sent a line starting
    /// with `expect` (none: nothing), then writes `answer` in one write. What the client
    /// sent comes back when the script ends and the client closed or `tail` was read.
    async fn scripted(
        script: Vec<(Option<&'static str>, String)>,
        tail: Option<&'static str>,
    ) -> (u16, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut seen = String::new();
            let mut buf = [0u8; 4096];
            let read_until = |seen: &mut String, needle: &str, from: usize| {
                seen.get(from..).is_some_and(|s| s.contains(needle))
            };
            let mut from = 0;
            for (expect, answer) in script {
                if let Some(expect) = expect {
                    while !read_until(&mut seen, expect, from) {
                        let n = socket.read(&mut buf).await.unwrap();
                        assert!(n > 0, "the client closed before {expect:?}: {seen}");
                        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                    }
                    from = seen.rfind(expect).unwrap() + expect.len();
                }
                socket.write_all(answer.as_bytes()).await.unwrap();
            }
            if let Some(tail) = tail {
                while !read_until(&mut seen, tail, from) {
                    let n = tokio::time::timeout(Duration::from_secs(10), socket.read(&mut buf))
                        .await
                        .expect("the client's tail in time")
                        .unwrap();
                    if n == 0 {
                        break;
                    }
                    seen.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
            seen
        });
        (port, task)
    }

    const INFO_LINE: &str = "INFO {\"server_id\":\"S\",\"version\":\"2.12.8\",\"proto\":1,\"headers\":true,\"max_payload\":1048576} \r\n";

    /// CN6, CN8: the account's INFO after CONNECT is applied; a PING in the same read as the
    /// subscription's PONG is the reader's (answered), not a failed handshake; CONNECT names
    /// the publishing connection and says no TLS for a plain one.
    #[tokio::test]
    async fn the_handshake_applies_the_account_info_and_hands_leftovers_to_the_reader() {
        let (port, server) = scripted(
            vec![
                (None, INFO_LINE.to_owned()),
                (
                    Some("PING\r\n"),
                    "PONG\r\nINFO {\"server_id\":\"S\",\"headers\":true,\"max_payload\":4096} \r\n"
                        .to_owned(),
                ),
                (Some("PING\r\n"), "PONG\r\nPING\r\n".to_owned()),
            ],
            Some("PONG\r\n"),
        )
        .await;
        let connection = connector(port)
            .open_with("_INBOX.t.".to_owned(), 8)
            .await
            .expect("the handshake succeeds with a PING after the subscription's PONG");
        assert_eq!(connection.max_payload(), 4096, "the account's max_payload");
        let seen = server.await.unwrap();
        assert!(
            seen.contains("\"name\":\"outbox-relay-publisher\""),
            "{seen}"
        );
        assert!(seen.contains("\"tls_required\":false"), "{seen}");
        assert!(seen.contains("SUB _INBOX.t.> 1\r\n"), "{seen}");
        assert!(
            seen.ends_with("PONG\r\n"),
            "the leftover PING was answered: {seen}"
        );
    }

    /// What the connector makes of `script`: it must refuse with `kind` for good, in words
    /// that contain `words`.
    async fn refused(
        script: Vec<(Option<&'static str>, String)>,
        kind: crate::Refusal,
        words: &str,
    ) {
        let (port, _server) = scripted(script, None).await;
        let error = connector(port)
            .open_with("_INBOX.t.".to_owned(), 8)
            .await
            .unwrap_err();
        assert!(
            matches!(&error, crate::error::SinkError::Refused { kind: k, .. } if *k == kind),
            "{error:?}"
        );
        assert!(!error.is_transient());
        assert!(error.to_string().contains(words), "{error}");
    }

    /// CN7: a server without headers, and a refused credential, are permanent.
    #[tokio::test]
    async fn no_headers_and_a_refused_credential_are_permanent() {
        let no_headers =
            "INFO {\"server_id\":\"S\",\"headers\":false,\"max_payload\":1048576} \r\n";
        refused(
            vec![(None, no_headers.to_owned())],
            crate::Refusal::NoHeaders,
            "headers",
        )
        .await;
        refused(
            vec![
                (None, INFO_LINE.to_owned()),
                (
                    Some("PING\r\n"),
                    "-ERR 'Authorization Violation'\r\n".to_owned(),
                ),
            ],
            crate::Refusal::Authentication,
            "Authorization Violation",
        )
        .await;
    }

    /// CN6, CN7: in a session, a denied publish reaches the acker and the connection stays
    /// open; lame-duck mode is flagged and remembered; connect_urls join the candidates.
    #[tokio::test]
    async fn in_session_infos_and_denials() {
        let (port, _server) = scripted(
            vec![
                (None, INFO_LINE.to_owned()),
                (Some("PING\r\n"), "PONG\r\n".to_owned()),
                (Some("PING\r\n"), "PONG\r\n".to_owned()),
                (
                    Some("HPUB"),
                    "-ERR 'Permissions Violation for Publish to \"orders.x\"'\r\nINFO {\"ldm\":true,\"connect_urls\":[\"127.0.0.1:1\",\"127.0.0.1:2\"]} \r\n".to_owned(),
                ),
            ],
            Some("never"),
        )
        .await;
        let connector = connector(port);
        let mut connection = connector
            .open_with("_INBOX.t.".to_owned(), 8)
            .await
            .unwrap();
        connection
            .frames
            .send(Bytes::from_static(
                b"HPUB orders.x _INBOX.t.1 12 12\r\nNATS/1.0\r\n\r\n\r\n",
            ))
            .await
            .unwrap();
        match connection.answers.recv().await {
            Some(Answer::Denied { subject, why }) => {
                assert_eq!(subject, "orders.x");
                assert!(why.contains("Permissions Violation"), "{why}");
            }
            other => panic!("expected the denial, got {other:?}"),
        }
        assert!(matches!(
            connection.answers.recv().await,
            Some(Answer::LameDuck)
        ));
        assert!(connection.lame_duck.load(Ordering::Relaxed));
        let mut ordered = connector.clone();
        ordered.randomize = false;
        let candidates: Vec<String> = ordered
            .candidates()
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            candidates,
            [
                "127.0.0.1:1".to_owned(),
                "127.0.0.1:2".to_owned(),
                format!("127.0.0.1:{port}"),
            ],
            "the advertised servers join; the lame-duck one is dialled last"
        );
    }

    /// CN9: a host's addresses are dialled one by one, each with its own timeout: one that
    /// swallows the connection does not keep the next from being tried.
    #[tokio::test]
    async fn every_address_is_dialled_with_its_own_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let good = listener.local_addr().unwrap();
        // A black hole: a listener that never accepts, its queue full, drops the SYN.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let full = socket.listen(0).unwrap();
        let black_hole = full.local_addr().unwrap();
        let mut fill = Vec::new();
        while fill.len() < 8 {
            match tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(black_hole))
                .await
            {
                Ok(Ok(tcp)) => fill.push(tcp),
                _ => break,
            }
        }
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let started = std::time::Instant::now();
        let tcp = dial_addresses(
            "nats.example",
            &[black_hole, closed, good],
            Duration::from_millis(300),
        )
        .await
        .expect("the last address connects");
        assert_eq!(tcp.peer_addr().unwrap(), good);
        assert!(started.elapsed() < Duration::from_secs(3));
        let error = dial_addresses(
            "nats.example",
            &[black_hole, closed],
            Duration::from_millis(300),
        )
        .await
        .unwrap_err();
        assert!(
            error.contains(&format!("{black_hole}: no answer within 300ms")),
            "{error}"
        );
        assert!(error.contains(&closed.to_string()), "{error}");
        drop(fill);
    }
}
