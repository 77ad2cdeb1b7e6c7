//! The metrics and health endpoint (`--metrics-addr`): `GET /metrics` (the Prometheus text
//! format), `/healthz` (200 while the process serves) and `/readyz` (200 `ready`, or 503
//! with the reason: [`crate::observe::metrics::Readiness`]); and [`get`], the client that
//! `outbox-relay probe`, the tests and the bench use.
//!
//! A minimal HTTP/1.1 responder on tokio rather than hyper: three read-only paths answered
//! from memory, one request per connection, need neither keep-alive, chunking nor request
//! bodies, and hyper 1 with hyper-util, http and http-body would more than double the code
//! the relay links for it. What it does accept, it bounds.
//!
//! # Invariants
//! - HTTP1 One request per connection (`Connection: close`), one deadline for the whole
//!   exchange: the head must arrive, and the answer be written, within [`EXCHANGE_TIMEOUT`],
//!   and the head fit [`MAX_HEAD`] bytes, or the connection is answered 400/431 (or just
//!   closed). A client that sends nothing, dribbles bytes or never reads its answer holds
//!   its task for at most that long. Each read scans only the bytes it added (and the three
//!   before them) for the head's end: the work per request is linear in its size.
//! - HTTP2 Every connection is accepted at once; no permit is taken before `accept`. At most
//!   [`MAX_CONNECTIONS`] exchanges run at once; a connection accepted while all are busy is
//!   answered `503` at once (by one of at most [`MAX_REJECTING`] short tasks, each bounded
//!   by [`REJECT_TIMEOUT`], which read what the client sent so that the answer is not lost
//!   to a reset; beyond those it is closed). Idle or slow clients therefore never leave a
//!   probe waiting: it is served, or told `503` at once. The relay's work never waits on a
//!   client.
//! - HTTP3 Nothing served carries a secret: metric values are numbers with fixed labels, and
//!   the readiness bodies are fixed texts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info};

use crate::error::{RelayError, Result};
use crate::observe::metrics::{Metrics, Readiness, CONTENT_TYPE};

/// How long one exchange may take, reading the head and writing the answer (HTTP1).
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest request head accepted (HTTP1).
pub const MAX_HEAD: usize = 8 * 1024;
/// Exchanges handled at once (HTTP2): idle connections up to this many leave every probe
/// served; each costs a task and at most [`MAX_HEAD`] bytes.
pub const MAX_CONNECTIONS: usize = 128;
/// Connections being answered `503` at once while all exchanges are busy (HTTP2).
pub const MAX_REJECTING: usize = 64;
/// How long a `503` answer may take, its write and reading what the client sent (HTTP2).
pub const REJECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Listens on `addr` and serves `metrics` until the returned handle is dropped. A port of 0
/// takes a free one; the log says which.
pub async fn start(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<AbortOnDropHandle<()>> {
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        RelayError::setup(anyhow::anyhow!(
            "cannot serve metrics on {addr}: {e} (set OUTBOX_RELAY_METRICS_ADDR, --metrics-addr or the file key metrics_addr to a free local address, or unset it)"
        ))
    })?;
    let bound = listener.local_addr().unwrap_or(addr);
    info!(address = %bound, "serving metrics and health on http://{bound}/metrics, /healthz, /readyz");
    Ok(AbortOnDropHandle::new(tokio::spawn(serve(
        listener, metrics,
    ))))
}

async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let exchanges = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let rejecting = Arc::new(Semaphore::new(MAX_REJECTING));
    loop {
        // HTTP2: accept first, whatever is busy.
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: try again shortly.
                debug!(error = %error, "cannot accept a metrics connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Ok(permit) = exchanges.clone().try_acquire_owned() {
            let metrics = metrics.clone();
            tokio::spawn(async move {
                if let Err(error) = handle(stream, &metrics).await {
                    debug!(peer = %peer, error = %error, "metrics request failed");
                }
                drop(permit);
            });
        } else if let Ok(permit) = rejecting.clone().try_acquire_owned() {
            tokio::spawn(async move {
                let _ = tokio::time::timeout(REJECT_TIMEOUT, reject(stream)).await;
                drop(permit);
            });
        } else {
            debug!(peer = %peer, "metrics connection closed: every exchange is busy");
        }
    }
}

/// Reads one request and answers it, all within [`EXCHANGE_TIMEOUT`] (HTTP1).
async fn handle(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    let exchange = async {
        let response = match read_head(&mut stream).await? {
            Some(head) => answer(&head, metrics),
            None => respond(431, "text/plain", "request head too large\n", false),
        };
        stream.write_all(&response).await?;
        stream.shutdown().await
    };
    match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
        Ok(result) => result,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no complete exchange within {EXCHANGE_TIMEOUT:?}"),
        )),
    }
}

/// Answers `503` without reading the request (HTTP2), then reads what the client sends until
/// it closes, so that closing does not reset the connection before the answer is read.
async fn reject(mut stream: TcpStream) -> std::io::Result<()> {
    let response = respond(
        503,
        "text/plain",
        "busy: every metrics connection is in use, retry\n",
        false,
    );
    stream.write_all(&response).await?;
    stream.shutdown().await?;
    let mut sink = [0u8; 1024];
    while stream.read(&mut sink).await? > 0 {}
    Ok(())
}

/// The request head up to its blank line; `None` if it exceeds [`MAX_HEAD`]. Each read's
/// bytes are scanned once (HTTP1).
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<String>> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let scanned = head.len();
        head.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_end(&head, scanned) {
            head.truncate(end);
            return Ok(Some(String::from_utf8_lossy(&head).into_owned()));
        }
        if head.len() > MAX_HEAD {
            return Ok(None);
        }
    }
}

/// Where the head in `bytes` ends (its blank line, `\r\n\r\n` or `\n\n`), given that
/// `bytes[..scanned]` held no end: only the new bytes and the three before them are looked at.
fn find_end(bytes: &[u8], scanned: usize) -> Option<usize> {
    let from = scanned.saturating_sub(3);
    bytes[from..]
        .windows(2)
        .enumerate()
        .find_map(|(i, pair)| match pair {
            b"\n\n" => Some(from + i),
            [b'\r', b'\n'] if bytes[from + i..].starts_with(b"\r\n\r\n") => Some(from + i),
            _ => None,
        })
}

/// The response to a request head.
fn answer(head: &str, metrics: &Metrics) -> Vec<u8> {
    let mut parts = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target, version) = (parts.next(), parts.next(), parts.next());
    let (Some(method), Some(target), Some(version)) = (method, target, version) else {
        return respond(400, "text/plain", "bad request\n", false);
    };
    if !version.starts_with("HTTP/1.") {
        return respond(400, "text/plain", "HTTP/1.0 or HTTP/1.1 only\n", false);
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return respond(405, "text/plain", "GET or HEAD only\n", false),
    };
    let path = target.split('?').next().unwrap_or(target);
    match path {
        "/metrics" => respond(200, CONTENT_TYPE, &metrics.render(), head_only),
        "/healthz" => respond(200, "text/plain", "ok\n", head_only),
        "/readyz" => {
            let readiness = metrics.readiness();
            let status = if readiness == Readiness::Ready {
                200
            } else {
                503
            };
            respond(status, "text/plain", &format!("{readiness}\n"), head_only)
        }
        _ => respond(
            404,
            "text/plain",
            "not found: /metrics, /healthz or /readyz\n",
            head_only,
        ),
    }
}

fn respond(status: u16, content_type: &str, body: &str, head_only: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    };
    let mut response = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        response.extend_from_slice(body.as_bytes());
    }
    response
}

/// The address to reach a server listening on `addr` from this host: the loopback address
/// for the unspecified one (`0.0.0.0`, `[::]`).
pub fn local_target(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => (Ipv4Addr::LOCALHOST, addr.port()).into(),
        IpAddr::V6(ip) if ip.is_unspecified() => (Ipv6Addr::LOCALHOST, addr.port()).into(),
        _ => addr,
    }
}

/// `GET path` from the server at `addr` (see [`local_target`]): its status and body, or
/// why it could not be had. Bounded by `timeout` as a whole.
pub async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> std::result::Result<(u16, String), String> {
    let addr = local_target(addr);
    let exchange = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("cannot send the request to {addr}: {e}"))?;
        let mut response = Vec::new();
        stream
            .take(64 << 20)
            .read_to_end(&mut response)
            .await
            .map_err(|e| format!("cannot read the response from {addr}: {e}"))?;
        Ok::<Vec<u8>, String>(response)
    };
    let response = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| format!("no response from {addr} within {timeout:?}"))??;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{addr} sent no HTTP response head"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("{addr} sent a malformed status line"))?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ends_at_its_first_blank_line_looking_only_at_new_bytes() {
        let head = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(find_end(head, 0), Some(23));
        assert_eq!(find_end(b"GET / HTTP/1.0\n\nrest", 0), Some(14));
        assert_eq!(find_end(b"GET / HTTP/1.0\r\n\nrest", 0), Some(15));
        assert_eq!(find_end(b"GET / HTTP/1.1\r\nHost: x\r\n", 0), None);
        // An end split across reads is found from the three bytes before the new ones.
        for scanned in 23..head.len() {
            assert_eq!(find_end(head, scanned), Some(23), "{scanned}");
        }
    }
}
