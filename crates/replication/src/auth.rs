//! What the client accepts while the server authenticates it: libpq's `channel_binding`
//! and `require_auth`, and the password's presence, checked by one [`AuthCheck`] on both
//! connections: the replication connection, which answers the server itself, and the
//! control connection, where tokio-postgres answers and [`AuthGuard`] reads each of the
//! server's requests before tokio-postgres sees it.
//!
//! # Invariants
//! - AU1 A request the policy refuses is refused before anything is sent in reply: no
//!   password, hash or SCRAM message goes out for a method `require_auth` excludes, and with
//!   `channel_binding=require` nothing goes out unless the connection is TLS with a
//!   certificate that has a `tls-server-end-point` hash and the server offers
//!   SCRAM-SHA-256-PLUS (so a cleartext, md5, plain SCRAM or passwordless downgrade fails).
//! - AU2 After SCRAM started, AuthenticationOk counts only once the server proved it knows
//!   the password (SASLFinal verified): a server that skips the proof is refused.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::BytesMut;
use postgres_protocol::authentication::sasl::SCRAM_SHA_256_PLUS;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::conninfo::{AuthMethod, ChannelBinding, ConnInfo, RequireAuth};
use crate::wire::{self, Authentication};
use crate::Error;

/// How the transport can bind SCRAM to the channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Transport {
    Plain,
    /// On TLS; the `tls-server-end-point` hash when the certificate's algorithm has one.
    Tls {
        end_point: Option<Vec<u8>>,
    },
}

/// The state of one authentication exchange, checked request by request.
#[derive(Debug)]
pub(crate) struct AuthCheck {
    user: String,
    has_password: bool,
    channel_binding: ChannelBinding,
    require_auth: Option<RequireAuth>,
    /// The method the server asked for first.
    method: Option<AuthMethod>,
    sasl_started: bool,
    sasl_proved: bool,
}

impl AuthCheck {
    /// The checks for `info` on `transport`. `channel_binding=require` without a channel
    /// to bind to is refused here, before the startup message.
    pub(crate) fn new(info: &ConnInfo, transport: &Transport) -> Result<Self, Error> {
        if info.channel_binding() == ChannelBinding::Require {
            match transport {
                Transport::Plain => {
                    return Err(Error::Auth(
                        "channel_binding=require, but the server does not use TLS; enable ssl \
                         on the server, or use sslmode=require so that this fails earlier"
                            .to_owned(),
                    ))
                }
                Transport::Tls { end_point: None } => {
                    return Err(Error::Auth(
                        "channel_binding=require, but the server's certificate has a signature \
                         algorithm without a tls-server-end-point hash (Ed25519, RSA-PSS); give \
                         the server an RSA or ECDSA certificate, or use channel_binding=prefer"
                            .to_owned(),
                    ))
                }
                Transport::Tls { end_point: Some(_) } => {}
            }
        }
        Ok(AuthCheck {
            user: info.user().to_owned(),
            has_password: info.password().is_some(),
            channel_binding: info.channel_binding(),
            require_auth: info.require_auth().cloned(),
            method: None,
            sasl_started: false,
            sasl_proved: false,
        })
    }

    /// Checks one request of the server before the client answers it (AU1, AU2).
    pub(crate) fn on_request(&mut self, request: &Authentication) -> Result<(), Error> {
        match request {
            Authentication::Ok => {
                if self.method.is_none() {
                    self.allow(AuthMethod::None)?;
                    self.refuse_downgrade("no authentication at all (trust)")?;
                }
                if self.sasl_started && !self.sasl_proved {
                    return Err(Error::Auth(
                        "the server ended SCRAM authentication without proving that it knows \
                         the password; this can mean a man-in-the-middle"
                            .to_owned(),
                    ));
                }
            }
            Authentication::CleartextPassword => {
                self.allow(AuthMethod::Password)?;
                self.refuse_downgrade("a cleartext password")?;
                self.need_password()?;
            }
            Authentication::Md5Password { .. } => {
                self.allow(AuthMethod::Md5)?;
                self.refuse_downgrade("an md5 password hash")?;
                self.need_password()?;
            }
            Authentication::Sasl { mechanisms } => {
                self.allow(AuthMethod::ScramSha256)?;
                if self.channel_binding == ChannelBinding::Require
                    && !mechanisms.iter().any(|m| m == SCRAM_SHA_256_PLUS)
                {
                    return Err(Error::Auth(format!(
                        "channel_binding=require, but the server offers SASL mechanisms \
                         {mechanisms:?} without SCRAM-SHA-256-PLUS; nothing was sent; {}",
                        DOWNGRADE_FIX
                    )));
                }
                self.need_password()?;
                self.sasl_started = true;
            }
            Authentication::SaslContinue(_) => {}
            Authentication::SaslFinal(_) => self.sasl_proved = true,
            Authentication::Unsupported(code) => match code {
                7 | 8 => self.allow(AuthMethod::Gss)?,
                9 => self.allow(AuthMethod::Sspi)?,
                _ => {}
            },
        }
        Ok(())
    }

    /// Records the method and checks it against `require_auth`.
    fn allow(&mut self, method: AuthMethod) -> Result<(), Error> {
        self.method.get_or_insert(method);
        match &self.require_auth {
            Some(require) if !require.allows(method) => Err(Error::Auth(format!(
                "the server asks for {} authentication (user {:?}), but require_auth={} does \
                 not allow it; nothing was sent; check pg_hba.conf on the server or require_auth",
                method_description(method),
                self.user,
                require.as_str()
            ))),
            _ => Ok(()),
        }
    }

    fn refuse_downgrade(&self, what: &str) -> Result<(), Error> {
        if self.channel_binding == ChannelBinding::Require {
            return Err(Error::Auth(format!(
                "channel_binding=require, but the server asks for {what} instead of \
                 SCRAM-SHA-256-PLUS; nothing was sent; {DOWNGRADE_FIX}"
            )));
        }
        Ok(())
    }

    fn need_password(&self) -> Result<(), Error> {
        if self.has_password {
            Ok(())
        } else {
            Err(no_password(&self.user))
        }
    }
}

const DOWNGRADE_FIX: &str = "hint: use scram-sha-256 for this user on hostssl lines of \
                             pg_hba.conf (with password_encryption=scram-sha-256), or set \
                             channel_binding=prefer";

/// The server wants a password and there is none.
pub(crate) fn no_password(user: &str) -> Error {
    Error::Auth(format!(
        "the server requires a password for user {user:?}, but none was given; hint: put \
         it in DATABASE_URL, PGPASSWORD or the password file (~/.pgpass or PGPASSFILE)"
    ))
}

fn method_description(method: AuthMethod) -> &'static str {
    match method {
        AuthMethod::None => "no",
        AuthMethod::Password => "cleartext password",
        AuthMethod::Md5 => "md5 password",
        AuthMethod::ScramSha256 => "SCRAM-SHA-256",
        AuthMethod::Gss => "GSSAPI",
        AuthMethod::Sspi => "SSPI",
    }
}

/// A stream that reads the server's authentication requests on their way to
/// tokio-postgres and applies an [`AuthCheck`] to each (AU1): a refused request never
/// reaches tokio-postgres, which fails with an I/O error; the refusal itself is left in the
/// shared slot for the caller to report. After AuthenticationOk it only passes bytes on.
pub(crate) struct AuthGuard<S> {
    inner: S,
    check: Option<AuthCheck>,
    pending: BytesMut,
    refusal: Arc<Mutex<Option<Error>>>,
    /// The TLS channel's `tls-server-end-point` hash, reported to tokio-postgres for
    /// channel binding (set by [`crate::connect_sql`]).
    pub(crate) end_point: Option<Vec<u8>>,
}

impl<S> AuthGuard<S> {
    pub(crate) fn new(inner: S, check: AuthCheck) -> (Self, Arc<Mutex<Option<Error>>>) {
        let refusal = Arc::new(Mutex::new(None));
        let guard = AuthGuard {
            inner,
            check: Some(check),
            pending: BytesMut::new(),
            refusal: refusal.clone(),
            end_point: None,
        };
        (guard, refusal)
    }

    /// Feeds bytes the server sent; `Err` when a request is refused.
    fn inspect(&mut self, bytes: &[u8]) -> Result<(), Error> {
        let Some(check) = self.check.as_mut() else {
            return Ok(());
        };
        self.pending.extend_from_slice(bytes);
        while let Some(frame) = wire::parse_frame(&mut self.pending)? {
            if frame.tag != wire::AUTHENTICATION {
                continue;
            }
            let request = wire::authentication(&frame.body)?;
            check.on_request(&request)?;
            if request == Authentication::Ok {
                self.check = None;
                self.pending = BytesMut::new();
                break;
            }
        }
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let new = buf.filled()[before..].to_vec();
        if let Err(error) = self.inspect(&new) {
            buf.set_filled(before);
            let message = error.to_string();
            *self.refusal.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                message,
            )));
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn check(conninfo: &str, transport: Transport) -> Result<AuthCheck, Error> {
        let info = ConnInfo::parse_with_env(conninfo, |_| None).unwrap();
        AuthCheck::new(&info, &transport)
    }

    fn bound() -> Transport {
        Transport::Tls {
            end_point: Some(vec![1; 32]),
        }
    }

    fn sasl(mechanisms: &[&str]) -> Authentication {
        Authentication::Sasl {
            mechanisms: mechanisms.iter().map(|m| m.to_string()).collect(),
        }
    }

    #[test]
    fn channel_binding_require_refuses_every_downgrade() {
        let require = "password=pw channel_binding=require sslmode=require";
        let error = check(require, Transport::Plain).unwrap_err();
        assert!(error.to_string().contains("does not use TLS"), "{error}");
        let error = check(require, Transport::Tls { end_point: None }).unwrap_err();
        assert!(
            error.to_string().contains("tls-server-end-point"),
            "{error}"
        );
        for (request, what) in [
            (Authentication::CleartextPassword, "a cleartext password"),
            (
                Authentication::Md5Password { salt: [0; 4] },
                "an md5 password hash",
            ),
            (Authentication::Ok, "no authentication at all"),
            (sasl(&["SCRAM-SHA-256"]), "without SCRAM-SHA-256-PLUS"),
        ] {
            let error = check(require, bound())
                .unwrap()
                .on_request(&request)
                .unwrap_err();
            assert!(matches!(error, Error::Auth(_)), "{error}");
            assert!(error.to_string().contains(what), "{error}");
            assert!(!error.is_transient());
        }
        let mut ok = check(require, bound()).unwrap();
        ok.on_request(&sasl(&["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]))
            .unwrap();
        ok.on_request(&Authentication::SaslContinue(Bytes::new()))
            .unwrap();
        // AU2: Ok without the server's proof is refused.
        let error = ok.on_request(&Authentication::Ok).unwrap_err();
        assert!(error.to_string().contains("without proving"), "{error}");
        ok.on_request(&Authentication::SaslFinal(Bytes::new()))
            .unwrap();
        ok.on_request(&Authentication::Ok).unwrap();
    }

    #[test]
    fn require_auth_refuses_other_methods_and_prefer_allows_all() {
        let mut scram_only =
            check("password=pw require_auth=scram-sha-256", Transport::Plain).unwrap();
        let error = scram_only
            .on_request(&Authentication::Md5Password { salt: [0; 4] })
            .unwrap_err();
        assert!(
            error.to_string().contains("md5 password authentication")
                && error.to_string().contains("require_auth=scram-sha-256"),
            "{error}"
        );
        let mut no_trust = check("password=pw require_auth=!none", Transport::Plain).unwrap();
        assert!(no_trust.on_request(&Authentication::Ok).is_err());
        let mut any = check("password=pw", Transport::Plain).unwrap();
        any.on_request(&Authentication::CleartextPassword).unwrap();
        any.on_request(&Authentication::Ok).unwrap();
        let mut trust = check("", Transport::Plain).unwrap();
        trust.on_request(&Authentication::Ok).unwrap();
        let error = check("", Transport::Plain)
            .unwrap()
            .on_request(&Authentication::CleartextPassword)
            .unwrap_err();
        assert!(error.to_string().contains("none was given"), "{error}");
    }

    #[tokio::test]
    async fn the_guard_withholds_a_refused_request_from_the_reader() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut server, client) = tokio::io::duplex(1024);
        let (mut guard, refusal) = AuthGuard::new(
            client,
            check("password=pw channel_binding=require", bound()).unwrap(),
        );
        // An md5 request: 'R', length 12, code 5, salt.
        server
            .write_all(&[b'R', 0, 0, 0, 12, 0, 0, 0, 5, 1, 2, 3, 4])
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let error = guard.read(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::PermissionDenied);
        assert!(error.to_string().contains("md5"), "{error}");
        assert!(refusal.lock().unwrap().is_some());
    }
}
