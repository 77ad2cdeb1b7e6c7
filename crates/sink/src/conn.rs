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
//! - C1 Every authentication and TLS mode of the relay's configuration works here as with
//!   async-nats: user and password, token, nkey, user JWT (a `.creds` file), TLS with a CA
//!   file or the system's roots, a client certificate, TLS upgraded after `INFO` (when the
//!   URL says `tls://`, the options ask for it or the server requires it) or first
//!   (`tls_first`). The `CONNECT` is async-nats's own [`async_nats::ConnectInfo`].
//! - C2 A connection is used only once the server answered `CONNECT` and `PING` with
//!   `PONG`, and the session's one subscription (`SUB {inbox}.* 1`) is written before any
//!   publish, on the same ordered stream, so the server knows it before it answers.
//! - C3 Nothing a session writes survives it: the connection is not re-established (no
//!   publish is ever re-sent by this module); when it fails, the acker learns why
//!   ([`Answer::Closed`], or the writer's channel closing) and the session ends (P3), and
//!   the next session opens a new connection and re-syncs from the stream (P5, P6). The
//!   acker reads the connection while it awaits no answer too, so an idle session ends when
//!   its connection closes, not at its next publish (`SinkError::Disconnected`).
//! - C4 The server's `PING`s are answered, so an idle session stays connected; `-ERR` and
//!   anything that is not the protocol close the connection and end the session with the
//!   server's words, rather than a silent ack timeout. The connection sends a `PING` of its
//!   own every [`Connector::ping_interval`]; when [`PINGS_UNANSWERED`] went unanswered, the
//!   server is gone without a word (a half-open connection) and the session ends with that.
//! - C5 Memory is bounded: answers wait in a channel of the window's size (P2) and frames
//!   in a channel of [`WRITE_QUEUE`] chunks; the read buffer holds at most one operation
//!   beyond what was read (the server's answers are small; `max_payload` bounds them).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::context::PublishError;
use bytes::{Buf, Bytes, BytesMut};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;

use crate::ack::{self, PubAck};
use crate::wire::{self, Parsed, ServerOp};

/// Chunks of frames the writer task may have queued (each is one batch of publishes, or a
/// `PONG`).
pub(crate) const WRITE_QUEUE: usize = 64;

/// How often a connection `PING`s the server by default: async-nats's default (C4).
pub const PING_INTERVAL: Duration = Duration::from_secs(60);

/// `PING`s the connection may have sent unanswered; one more interval and it is closed (C4).
pub const PINGS_UNANSWERED: u32 = 2;

/// The subscription id of the session's answers.
const SID: u64 = 1;

/// The longest control line the server sends us that we accept (its `INFO` grows with the
/// cluster's URLs).
const MAX_INFO_LINE: usize = 1 << 20;

/// A credential the publishing connection presents (C1).
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

/// Where and how the sink opens its publishing connection (C1).
#[derive(Debug, Clone)]
pub struct Connector {
    /// Server URLs (`nats://host:port`, `tls://host:port` or `host[:port]`), tried in order.
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
    /// How long connecting to one server may take.
    pub timeout: Duration,
    /// How often the connection `PING`s the server (C4).
    pub ping_interval: Duration,
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
            name: "outbox-relay".into(),
            timeout: Duration::from_secs(5),
            ping_interval: PING_INTERVAL,
        }
    }

    /// Opens a session's publishing connection: to the first server that accepts us,
    /// subscribed to `{inbox}.*` (C2), `inbox` a fresh inbox of `client` (under its inbox
    /// prefix). `window` is the session's window: the capacity of the answers' channel (C5).
    /// Opened before the session says it streams, so a session that streams can publish.
    pub async fn open(
        &self,
        client: &async_nats::Client,
        window: usize,
    ) -> Result<Connection, crate::SinkError> {
        let mut reply_prefix = client.new_inbox();
        reply_prefix.push('.');
        let mut failures = Vec::new();
        for server in &self.servers {
            match tokio::time::timeout(self.timeout, self.open_one(server, &reply_prefix)).await {
                Ok(Ok((stream, info))) => {
                    return Ok(Connection::start(
                        stream,
                        info,
                        reply_prefix,
                        window,
                        self.ping_interval,
                    ))
                }
                Ok(Err(Failure::Other(why))) => {
                    failures.push(format!("{}: {why}", redact(server)));
                }
                Ok(Err(Failure::Subscription(why))) => {
                    return Err(crate::SinkError::SubscriptionRefused {
                        subject: format!("{reply_prefix}*"),
                        why,
                    });
                }
                Err(_) => failures.push(format!(
                    "{}: no answer within {:?}",
                    redact(server),
                    self.timeout
                )),
            }
        }
        Err(crate::SinkError::Connect(if failures.is_empty() {
            "no NATS server is configured".to_owned()
        } else {
            failures.join("; ")
        }))
    }

    async fn open_one(&self, server: &str, reply_prefix: &str) -> Result<(Stream, Info), Failure> {
        let address = Address::parse(server)?;
        let tcp = TcpStream::connect((address.host.as_str(), address.port))
            .await
            .map_err(|e| format!("cannot connect: {e}"))?;
        tcp.set_nodelay(true)
            .map_err(|e| format!("cannot set TCP_NODELAY: {e}"))?;
        let mut stream: Stream = Box::new(tcp);
        let mut buffer = BytesMut::with_capacity(4096);
        if self.tls_first {
            stream = self.tls(stream, &address.host).await?;
        }
        let info = match read_op(&mut stream, &mut buffer, |op| match op {
            ServerOp::Info(json) => Some(Info::parse(json)),
            _ => None,
        })
        .await?
        {
            Some(info) => info?,
            None => return Err("the server's first message is not INFO".into()),
        };
        if !self.tls_first && (self.tls_required || address.tls || info.tls_required) {
            stream = self.tls(stream, &address.host).await?;
        }
        let connect = self.connect_json(&info)?;
        let mut hello = Vec::with_capacity(connect.len() + 64);
        hello.extend_from_slice(b"CONNECT ");
        hello.extend_from_slice(connect.as_bytes());
        hello.extend_from_slice(b"\r\nPING\r\n");
        send(&mut stream, &hello, "cannot send CONNECT").await?;
        // C2: PONG, or the server's refusal.
        if let Err(text) = pong(&mut stream, &mut buffer).await? {
            return Err(Failure::Other(format!("the server refused us: {text}")));
        }
        // C2: the subscription, confirmed by the next PONG: a server that forbids it says so
        // first (a permissions violation leaves the connection open).
        let subscribe = format!("SUB {reply_prefix}* {SID}\r\nPING\r\n");
        send(&mut stream, subscribe.as_bytes(), "cannot subscribe").await?;
        if let Err(text) = pong(&mut stream, &mut buffer).await? {
            return Err(Failure::Subscription(text));
        }
        if !buffer.is_empty() {
            return Err("the server sent more than PONG before we published".into());
        }
        Ok((stream, info))
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

    fn connect_json(&self, info: &Info) -> Result<String, String> {
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
            tls_required: self.tls_required || self.tls_first,
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

/// What the session needs of the server's `INFO`.
#[derive(Debug, Clone)]
pub(crate) struct Info {
    pub(crate) max_payload: usize,
    tls_required: bool,
    nonce: String,
}

impl Info {
    fn parse(json: &[u8]) -> Result<Info, String> {
        #[derive(serde::Deserialize)]
        struct Raw {
            #[serde(default)]
            max_payload: usize,
            #[serde(default)]
            tls_required: bool,
            #[serde(default)]
            nonce: String,
        }
        let raw: Raw = serde_json::from_slice(json)
            .map_err(|e| format!("the server's INFO is not JSON: {e}"))?;
        Ok(Info {
            max_payload: raw.max_payload,
            tls_required: raw.tls_required,
            nonce: raw.nonce,
        })
    }
}

/// A server URL taken apart.
#[derive(Debug, PartialEq, Eq)]
struct Address {
    host: String,
    port: u16,
    tls: bool,
}

impl Address {
    fn parse(server: &str) -> Result<Address, String> {
        let (tls, rest) = match server.split_once("://") {
            Some((scheme, rest)) => match scheme.to_ascii_lowercase().as_str() {
                "nats" => (false, rest),
                "tls" => (true, rest),
                other => {
                    return Err(format!(
                        "the publishing connection does not speak {other}://"
                    ))
                }
            },
            None => (false, server),
        };
        // User information was taken out by the relay; a path or query has no meaning.
        let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
        let rest = rest.split(['/', '?']).next().unwrap_or_default();
        let (host, port) = match rest.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((host, port)) => (host, port.strip_prefix(':')),
                None => return Err("an IPv6 address without its closing ']'".into()),
            },
            None => match rest.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            },
        };
        let port = match port {
            Some(port) => port
                .parse()
                .map_err(|_| format!("{port:?} is not a port number"))?,
            None => 4222,
        };
        if host.is_empty() {
            return Err("the URL has no host".into());
        }
        Ok(Address {
            host: host.to_owned(),
            port,
            tls,
        })
    }
}

/// A URL without its user information, for messages.
fn redact(server: &str) -> String {
    match server.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://{host}"),
            None => server.to_owned(),
        },
        None => server
            .rsplit_once('@')
            .map_or(server, |(_, h)| h)
            .to_owned(),
    }
}

/// The system's roots, for a server that needs TLS when the options name no CA (C1), as
/// async-nats does.
fn system_tls() -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("no usable TLS protocol version: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
type Stream = Box<dyn Io>;

/// Writes and flushes `bytes`; an error says `what` failed.
async fn send(stream: &mut Stream, bytes: &[u8], what: &str) -> Result<(), String> {
    stream
        .write_all(bytes)
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    stream.flush().await.map_err(|e| format!("{what}: {e}"))
}

/// Why a server could not be used.
enum Failure {
    /// It refused the session's subscription (a permission): every server of the account
    /// will, so none is tried after it.
    Subscription(String),
    /// Anything else: the next server is tried.
    Other(String),
}

impl From<String> for Failure {
    fn from(why: String) -> Self {
        Failure::Other(why)
    }
}

impl From<&str> for Failure {
    fn from(why: &str) -> Self {
        Failure::Other(why.to_owned())
    }
}

/// Reads until the server's `PONG` (`Ok(Ok)`) or its `-ERR` (`Ok(Err)`, its words).
async fn pong(stream: &mut Stream, buffer: &mut BytesMut) -> Result<Result<(), String>, String> {
    loop {
        let answer = read_op(stream, buffer, |op| match op {
            ServerOp::Pong => Some(Ok(())),
            ServerOp::Err(text) => Some(Err(String::from_utf8_lossy(text).into_owned())),
            _ => None,
        })
        .await?;
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
    take: impl Fn(ServerOp<'_>) -> Option<T>,
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
    /// The answer to the session's publish number `sequence`, read (K1–K3).
    Ack {
        sequence: u64,
        ack: Result<Acked, PublishError>,
    },
    /// The connection is gone: why (C3, C4).
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

/// An open publishing connection ([`Connector::open`]), for one session of
/// [`crate::run`]: its writer's queue, its answers, the server's `INFO`, the prefix of its
/// reply subjects and its tasks.
#[derive(Debug)]
pub struct Connection {
    pub(crate) frames: mpsc::Sender<Bytes>,
    pub(crate) answers: mpsc::Receiver<Answer>,
    pub(crate) info: Info,
    /// `{inbox}.`: publish number `n` asks for its answer on `{inbox}.{n}` (P10).
    pub(crate) reply_prefix: String,
    /// The writer and reader tasks, aborted when dropped.
    pub(crate) tasks: (AbortOnDropHandle<()>, AbortOnDropHandle<()>),
}

impl Connection {
    fn start(
        stream: Stream,
        info: Info,
        reply_prefix: String,
        answers: usize,
        ping_interval: Duration,
    ) -> Connection {
        let (read, write) = tokio::io::split(stream);
        let (frames_tx, frames_rx) = mpsc::channel(WRITE_QUEUE);
        let (answers_tx, answers_rx) = mpsc::channel(answers.max(1) + 16);
        let unanswered = Arc::new(AtomicU32::new(0));
        let writer = AbortOnDropHandle::new(tokio::spawn(write_frames(
            write,
            frames_rx,
            answers_tx.clone(),
            (ping_interval, unanswered.clone()),
        )));
        let reader = AbortOnDropHandle::new(tokio::spawn(read_answers(
            read,
            frames_tx.clone(),
            answers_tx,
            reply_prefix.clone(),
            info.max_payload,
            unanswered,
        )));
        Connection {
            frames: frames_tx,
            answers: answers_rx,
            info,
            reply_prefix,
            tasks: (writer, reader),
        }
    }
}

/// The writer task: writes each queued chunk, and whatever else is queued behind it, then
/// flushes (TLS buffers records); `PING`s every `ping.0`, counting in `ping.1` the ones
/// the reader has not seen answered, and closes the connection when too many were not (C4).
async fn write_frames(
    mut write: tokio::io::WriteHalf<Stream>,
    mut frames: mpsc::Receiver<Bytes>,
    answers: mpsc::Sender<Answer>,
    ping: (Duration, Arc<AtomicU32>),
) {
    let (interval, unanswered) = ping;
    let mut pings = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    pings.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let result = async {
        loop {
            tokio::select! {
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

/// The reader task: answers `PING`, hands every answer on the session's subscription to the
/// acker, read and owned, and ends with [`Answer::Closed`] (C3, C4).
async fn read_answers(
    mut read: tokio::io::ReadHalf<Stream>,
    frames: mpsc::Sender<Bytes>,
    answers: mpsc::Sender<Answer>,
    reply_prefix: String,
    max_payload: usize,
    unanswered: Arc<AtomicU32>,
) {
    let mut buffer = BytesMut::with_capacity(64 * 1024);
    let max_payload = if max_payload == 0 {
        MAX_INFO_LINE
    } else {
        max_payload
    };
    let why = loop {
        let mut closed = None;
        loop {
            let (answer, used) = match wire::parse(&buffer, MAX_INFO_LINE, max_payload) {
                Parsed::Op(op, used) => (answer_of(op, &reply_prefix), used),
                Parsed::Incomplete => break,
                Parsed::Invalid(why) => {
                    closed = Some(format!(
                        "the NATS server sent what is not the protocol: {why}"
                    ));
                    break;
                }
            };
            buffer.advance(used);
            match answer {
                Reading::Answer(answer) => {
                    if answers.send(answer).await.is_err() {
                        return;
                    }
                }
                Reading::Ping => {
                    if frames.send(Bytes::from_static(b"PONG\r\n")).await.is_err() {
                        return;
                    }
                }
                Reading::Pong => unanswered.store(0, Ordering::Relaxed),
                Reading::Error(text) => {
                    closed = Some(format!("the NATS server said: {text}"));
                    break;
                }
                Reading::Nothing => {}
            }
        }
        if let Some(why) = closed {
            break why;
        }
        match read.read_buf(&mut buffer).await {
            Ok(0) => break "the NATS server closed the connection".to_owned(),
            Ok(_) => {}
            Err(error) => break format!("cannot read from NATS: {error}"),
        }
    };
    let _ = answers.send(Answer::Closed(why)).await;
}

enum Reading {
    Answer(Answer),
    Ping,
    /// The answer to one of our `PING`s (C4).
    Pong,
    Error(String),
    Nothing,
}

fn answer_of(op: ServerOp<'_>, reply_prefix: &str) -> Reading {
    match op {
        ServerOp::Msg {
            subject,
            sid,
            headers,
            payload,
            ..
        } if sid == SID => {
            let Some(sequence) = subject
                .strip_prefix(reply_prefix.as_bytes())
                .and_then(|n| std::str::from_utf8(n).ok())
                .and_then(|n| n.parse().ok())
            else {
                return Reading::Nothing;
            };
            let status = headers.and_then(wire::status);
            Reading::Answer(Answer::Ack {
                sequence,
                ack: ack::read_parts(status, payload).map(Acked::from),
            })
        }
        ServerOp::Ping => Reading::Ping,
        ServerOp::Pong => Reading::Pong,
        ServerOp::Err(text) => Reading::Error(String::from_utf8_lossy(text).into_owned()),
        _ => Reading::Nothing,
    }
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
                tls: false
            }
        );
        assert_eq!(
            a("tls://nats.example.com").unwrap(),
            Address {
                host: "nats.example.com".into(),
                port: 4222,
                tls: true
            }
        );
        assert_eq!(
            a("localhost:5").unwrap(),
            Address {
                host: "localhost".into(),
                port: 5,
                tls: false
            }
        );
        assert_eq!(
            a("nats://[::1]:4222").unwrap(),
            Address {
                host: "::1".into(),
                port: 4222,
                tls: false
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
}
