//! Opening a connection: dialling each address, TLS, the server's INFO, CONNECT and the
//! replies' subscription (CN1, CN2), failures kept apart by what the caller does next.

use super::*;

/// Resolves `host` and connects to each of its addresses in turn, each with its own
/// `timeout` (CN9); an address that failed is logged with why, before the next is tried.
pub(super) async fn dial(host: &str, port: u16, timeout: Duration) -> Result<TcpStream, String> {
    let addresses: Vec<SocketAddr> =
        match tokio::time::timeout(timeout, tokio::net::lookup_host((host, port))).await {
            Ok(Ok(addresses)) => addresses.collect(),
            Ok(Err(e)) => return Err(format!("cannot resolve {host}: {e}")),
            Err(_) => return Err(format!("cannot resolve {host} within {timeout:?}")),
        };
    dial_addresses(host, &addresses, timeout).await
}

/// [`dial`] once `host` is resolved to `addresses`.
pub(super) async fn dial_addresses(
    host: &str,
    addresses: &[SocketAddr],
    timeout: Duration,
) -> Result<TcpStream, String> {
    let mut failures = Vec::new();
    for (n, address) in addresses.iter().enumerate() {
        let why = match tokio::time::timeout(timeout, TcpStream::connect(address)).await {
            Ok(Ok(tcp)) => return Ok(tcp),
            Ok(Err(e)) => format!("cannot connect to {address}: {e}"),
            Err(_) => format!("cannot connect to {address}: no answer within {timeout:?}"),
        };
        if n + 1 < addresses.len() {
            warn!(host, address = %address, reason = %why, "NATS: trying the next address of the host");
        }
        failures.push(why);
    }
    Err(if failures.is_empty() {
        format!("{host} resolves to no address")
    } else {
        failures.join(", ")
    })
}

/// What the session keeps of the server's `INFO`s (CN6).
#[derive(Debug, Clone, Default)]
pub(crate) struct Info {
    pub(crate) max_payload: usize,
    pub(super) tls_required: bool,
    pub(super) nonce: String,
    pub(super) headers: bool,
    pub(super) ldm: bool,
    pub(super) connect_urls: Option<Vec<String>>,
}

#[derive(serde::Deserialize)]
pub(super) struct RawInfo {
    pub(super) max_payload: Option<usize>,
    pub(super) tls_required: Option<bool>,
    pub(super) nonce: Option<String>,
    pub(super) headers: Option<bool>,
    #[serde(default)]
    pub(super) ldm: bool,
    pub(super) connect_urls: Option<Vec<String>>,
}

impl Info {
    /// The server's first `INFO`.
    pub(super) fn parse(json: &[u8]) -> Result<Info, String> {
        let mut info = Info::default();
        info.update(json)?;
        Ok(info)
    }

    /// Applies a later `INFO` (CN6): what it says replaces what an earlier one said, except
    /// that `max_payload` only goes down (an account's limit under the server's); `ldm` is
    /// what the latest says.
    pub(super) fn update(&mut self, json: &[u8]) -> Result<(), String> {
        let raw: RawInfo = serde_json::from_slice(json)
            .map_err(|e| format!("the server's INFO is not JSON: {e}"))?;
        if let Some(max_payload) = raw.max_payload.filter(|&m| m > 0) {
            self.max_payload = if self.max_payload == 0 {
                max_payload
            } else {
                self.max_payload.min(max_payload)
            };
        }
        if let Some(tls_required) = raw.tls_required {
            self.tls_required = tls_required;
        }
        if let Some(nonce) = raw.nonce {
            self.nonce = nonce;
        }
        if let Some(headers) = raw.headers {
            self.headers = headers;
        }
        self.ldm = raw.ldm;
        self.connect_urls = raw.connect_urls;
        Ok(())
    }
}

/// A server URL taken apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Address {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) tls: bool,
    /// The name TLS verifies, when not `host` (an advertised IP address, CN6).
    pub(super) tls_name: Option<String>,
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Address {
    pub(super) fn parse(server: &str) -> Result<Address, String> {
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
            tls_name: None,
        })
    }

    /// The same server: host (ignoring case) and port.
    pub(super) fn same_server(&self, other: &Address) -> bool {
        self.port == other.port && self.host.eq_ignore_ascii_case(&other.host)
    }
}

/// A URL without its user information, for messages.
pub(super) fn redact(server: &str) -> String {
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

/// The system's trusted roots, for a server that needs TLS when the options name no CA
/// (CN1), as async-nats takes them; an error when none could be loaded, naming why (the
/// loader's errors), and a warning for the certificates that could not be read when
/// others could.
pub fn system_roots() -> Result<rustls::RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, unparsable) = roots.add_parsable_certificates(found.certs);
    let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
    if added == 0 {
        return Err(format!(
            "no trusted root certificate was found on this system{}: install the ca-certificates package, set SSL_CERT_FILE, or give the CA file",
            if errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", errors.join("; "))
            }
        ));
    }
    if !errors.is_empty() || unparsable > 0 {
        warn!(
            loaded = added,
            unparsable,
            errors = %errors.join("; "),
            "some of the system's root certificates could not be loaded"
        );
    }
    Ok(roots)
}

/// A TLS configuration with the system's roots (CN1).
pub(super) fn system_tls() -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = system_roots()?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("no usable TLS protocol version: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

pub(super) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
pub(super) type Stream = Box<dyn Io>;

/// The server's first message, its `INFO`, which must announce header support.
pub(super) async fn first_info(
    stream: &mut Stream,
    buffer: &mut BytesMut,
) -> Result<Info, Failure> {
    let mut update = None;
    let first = read_op(stream, buffer, |op| match op {
        ServerOp::Info(json) => {
            update = Some(json.to_vec());
            Some(())
        }
        _ => None,
    })
    .await?;
    let info = match (first, update) {
        (Some(()), Some(json)) => Info::parse(&json)?,
        _ => return Err("the server's first message is not INFO".into()),
    };
    if !info.headers {
        return Err(Failure::Refused(
            crate::Refusal::NoHeaders,
            "the server does not support message headers (\"headers\": false in its INFO), which every JetStream publish needs: remove no_header_support from its configuration, or upgrade it to nats-server 2.2 or later".to_owned(),
        ));
    }
    Ok(info)
}

/// `CONNECT` (its JSON, `connect`) and a `PING`: CN2, the `PONG` or the server's refusal; CN6,
/// an `INFO` after `CONNECT` is applied to `info`.
pub(super) async fn hello(
    stream: &mut Stream,
    buffer: &mut BytesMut,
    info: &mut Info,
    connect: &str,
) -> Result<(), Failure> {
    let mut hello = Vec::with_capacity(connect.len() + 64);
    hello.extend_from_slice(b"CONNECT ");
    hello.extend_from_slice(connect.as_bytes());
    hello.extend_from_slice(b"\r\nPING\r\n");
    send(stream, &hello, "cannot send CONNECT").await?;
    match pong(stream, buffer, info).await? {
        Ok(()) => Ok(()),
        Err(text) => Err(match classify(&text) {
            ServerError::Authentication => Failure::Refused(
                crate::Refusal::Authentication,
                format!("the server refused us: {text}"),
            ),
            _ => Failure::Other(format!("the server refused us: {text}")),
        }),
    }
}

/// CN2: the subscription to `{reply_prefix}>`, confirmed by the next `PONG`: a server that
/// forbids it says so first (a permissions violation leaves the connection open).
pub(super) async fn subscribe(
    stream: &mut Stream,
    buffer: &mut BytesMut,
    info: &mut Info,
    reply_prefix: &str,
) -> Result<(), Failure> {
    let subscribe = format!("SUB {reply_prefix}> {SID}\r\nPING\r\n");
    send(stream, subscribe.as_bytes(), "cannot subscribe").await?;
    match pong(stream, buffer, info).await? {
        Ok(()) => Ok(()),
        Err(text) => Err(Failure::Subscription(text)),
    }
}

/// Writes and flushes `bytes`; an error says `what` failed.
pub(super) async fn send(stream: &mut Stream, bytes: &[u8], what: &str) -> Result<(), String> {
    stream
        .write_all(bytes)
        .await
        .map_err(|e| format!("{what}: {e}"))?;
    stream.flush().await.map_err(|e| format!("{what}: {e}"))
}

/// Why a server could not be used.
pub(super) enum Failure {
    /// It refused the session's subscription (a permission): every server of the account
    /// will, so none is tried after it.
    Subscription(String),
    /// It refused us for good (CN7): none is tried after it.
    Refused(crate::Refusal, String),
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
