//! A TLS-terminating front for a plain server, as a load balancer that terminates TLS in
//! front of nats-server is: it expects the TLS handshake the moment a client connects
//! (nothing is sent before it) and forwards the decrypted bytes both ways to `upstream`.
//! That is the set-up a client's "TLS first" (nats-server's `handshake_first`) exists for,
//! and the only way to try it with nats-server 2.9, which has no `handshake_first`.
//!
//! A thread of its own runs the front on a current-thread tokio runtime, so it is usable
//! from sync and async tests alike; dropping the handle stops it and closes every
//! connection.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// A running TLS-terminating front (see the module docs).
#[derive(Debug)]
pub struct TlsFront {
    addr: SocketAddr,
    handshakes: Arc<AtomicUsize>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TlsFront {
    /// Listens on 127.0.0.1:{free port}, presenting the certificate chain in `cert` (PEM)
    /// with the key in `key`, and forwards each connection to `upstream` once its TLS
    /// handshake completes.
    pub fn start(upstream: SocketAddr, cert: &Path, key: &Path) -> TlsFront {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .expect("testkit: read the front's certificate")
            .collect::<Result<_, _>>()
            .expect("testkit: parse the front's certificate");
        let key = PrivateKeyDer::from_pem_file(key).expect("testkit: read the front's key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("testkit: TLS versions")
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .expect("testkit: the front's certificate and key");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind(("127.0.0.1", crate::free_port()))
            .expect("testkit: bind the TLS front");
        listener
            .set_nonblocking(true)
            .expect("testkit: a non-blocking listener");
        let addr = listener.local_addr().expect("testkit: the front's address");
        let handshakes = Arc::new(AtomicUsize::new(0));
        let (stop, stopped) = oneshot::channel();
        let counted = handshakes.clone();
        let thread = thread::Builder::new()
            .name(format!("testkit-tls-front-{}", addr.port()))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("testkit: the TLS front's runtime");
                runtime.block_on(async move {
                    let listener =
                        TcpListener::from_std(listener).expect("testkit: the front's listener");
                    tokio::select! {
                        _ = stopped => {}
                        () = serve(listener, acceptor, upstream, counted) => {}
                    }
                });
                // Dropping the runtime drops every connection's task.
            })
            .expect("testkit: spawn the TLS front's thread");
        TlsFront {
            addr,
            handshakes,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// The front's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// TLS handshakes completed so far.
    pub fn handshakes(&self) -> usize {
        self.handshakes.load(Ordering::SeqCst)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Accepts until the runtime stops: each connection in a task of its own.
async fn serve(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    upstream: SocketAddr,
    handshakes: Arc<AtomicUsize>,
) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let (acceptor, handshakes) = (acceptor.clone(), handshakes.clone());
        tokio::spawn(async move {
            // A client that does not start with a TLS handshake gets nothing and is closed.
            let Ok(mut client) = acceptor.accept(client).await else {
                return;
            };
            handshakes.fetch_add(1, Ordering::SeqCst);
            let Ok(mut server) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
        });
    }
}
