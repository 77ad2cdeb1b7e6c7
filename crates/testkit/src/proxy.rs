//! A fault-injecting TCP proxy.

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct Conn {
    id: u64,
    client: TcpStream,
    upstream: TcpStream,
    closed: AtomicBool,
    pumps_left: AtomicUsize,
}

impl Conn {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

#[derive(Debug, Default)]
struct Inner {
    conns: Mutex<Vec<Arc<Conn>>>,
    blackhole: Mutex<bool>,
    blackhole_changed: Condvar,
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Where new connections go ([`Proxy::redirect`]); `None` until started.
    upstream: Mutex<Option<SocketAddr>>,
}

impl Inner {
    fn conns(&self) -> MutexGuard<'_, Vec<Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn blackhole(&self) -> MutexGuard<'_, bool> {
        self.blackhole
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn upstream(&self) -> Option<SocketAddr> {
        *self.upstream.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remove(&self, id: u64) {
        self.conns().retain(|c| c.id != id);
    }
}

/// A TCP proxy on a free loopback port that forwards every connection to
/// `upstream`, for faults a real server cannot produce: [`Proxy::cut`]
/// closes all current connections, [`Proxy::set_blackhole`] holds back the
/// server's replies. Thread-based: an accept loop plus two pump threads per
/// connection. Dropping it stops accepting and cuts all connections.
pub struct Proxy {
    addr: SocketAddr,
    inner: Arc<Inner>,
    accept_thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.inner.upstream())
            .field("connections", &self.connection_count())
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// Listen on 127.0.0.1:{free port} and forward to `upstream`. A client
    /// whose upstream connection fails is disconnected.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .expect("testkit: bind the proxy listener on 127.0.0.1:0");
        let addr = listener
            .local_addr()
            .expect("testkit: local_addr of the proxy listener");
        let inner = Arc::new(Inner::default());
        *inner
            .upstream
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(upstream);
        let accept_inner = Arc::clone(&inner);
        let accept_thread = thread::Builder::new()
            .name(format!("testkit-proxy-{}", addr.port()))
            .spawn(move || accept_loop(&listener, &accept_inner))
            .expect("testkit: spawn the proxy accept thread");
        Proxy {
            addr,
            inner,
            accept_thread: Some(accept_thread),
        }
    }

    /// The proxy's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// The proxy's address (127.0.0.1:{port}).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Close every current connection at once: both sockets of each are
    /// `shutdown(Both)`, so the client sees EOF/reset and the server sees the
    /// connection go away. New connections are still accepted.
    pub fn cut(&self) {
        let conns = std::mem::take(&mut *self.inner.conns());
        for conn in &conns {
            conn.close();
        }
        self.inner.blackhole_changed.notify_all();
    }

    /// While on, bytes from upstream to client are held back (not forwarded,
    /// not dropped): the client sees no replies/acks. Switching it off lets
    /// them flow again, in order. Client-to-upstream traffic is unaffected.
    pub fn set_blackhole(&self, on: bool) {
        *self.inner.blackhole() = on;
        self.inner.blackhole_changed.notify_all();
    }

    /// Sends new connections to `upstream` from now on (a DNS name or a virtual IP moved to
    /// another server); current connections stay where they are until [`Proxy::cut`].
    pub fn redirect(&self, upstream: SocketAddr) {
        *self
            .inner
            .upstream
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(upstream);
    }

    /// Connections currently open through the proxy.
    pub fn connection_count(&self) -> usize {
        self.inner.conns().len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept().
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(handle) = self.accept_thread.take() {
            let _ = handle.join();
        }
        self.cut();
    }
}

fn accept_loop(listener: &TcpListener, inner: &Arc<Inner>) {
    for client in listener.incoming() {
        if inner.stopping.load(Ordering::SeqCst) {
            return;
        }
        let client = match client {
            Ok(client) => client,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(upstream) = inner.upstream() else {
            continue;
        };
        let Ok(upstream_stream) = TcpStream::connect_timeout(&upstream, CONNECT_TIMEOUT) else {
            // Upstream down: the client sees its connection closed.
            continue;
        };
        if let Err(e) = start_connection(client, upstream_stream, inner) {
            eprintln!("testkit proxy: could not set up a connection: {e}");
        }
    }
}

fn start_connection(
    client: TcpStream,
    upstream: TcpStream,
    inner: &Arc<Inner>,
) -> std::io::Result<()> {
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let conn = Arc::new(Conn {
        id: inner.next_id.fetch_add(1, Ordering::SeqCst),
        client: client.try_clone()?,
        upstream: upstream.try_clone()?,
        closed: AtomicBool::new(false),
        pumps_left: AtomicUsize::new(2),
    });
    let client_read = client.try_clone()?;
    let upstream_read = upstream.try_clone()?;
    inner.conns().push(Arc::clone(&conn));

    let spawn_pump = |from: TcpStream, to: TcpStream, hold: bool, label: &str| {
        let conn = Arc::clone(&conn);
        let inner = Arc::clone(inner);
        thread::Builder::new()
            .name(format!("testkit-proxy-{}-{label}", conn.id))
            .spawn(move || pump(from, to, hold, &conn, &inner))
    };
    if let Err(e) = spawn_pump(client_read, upstream, false, "up") {
        conn.close();
        inner.remove(conn.id);
        return Err(e);
    }
    if let Err(e) = spawn_pump(upstream_read, client, true, "down") {
        conn.close();
        inner.remove(conn.id);
        return Err(e);
    }
    Ok(())
}

/// Copy `from` -> `to`. With `hold`, data waits while the blackhole is on.
fn pump(mut from: TcpStream, mut to: TcpStream, hold: bool, conn: &Conn, inner: &Inner) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => {
                // Propagate the half-close.
                let _ = to.shutdown(Shutdown::Write);
                break;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => {
                conn.close();
                break;
            }
        };
        if hold {
            let mut on = inner.blackhole();
            while *on && !conn.closed.load(Ordering::SeqCst) {
                on = inner
                    .blackhole_changed
                    .wait_timeout(on, Duration::from_millis(100))
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
        if conn.closed.load(Ordering::SeqCst) {
            break;
        }
        if to.write_all(&buf[..n]).is_err() {
            conn.close();
            break;
        }
    }
    if conn.pumps_left.fetch_sub(1, Ordering::SeqCst) == 1 {
        conn.close();
        inner.remove(conn.id);
    }
}
