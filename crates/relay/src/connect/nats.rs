//! NATS connections: the configuration's servers, credential and TLS files
//! ([`crate::config::nats`], whose invariants NATS1–NATS6 these keep) turned into an async-nats
//! client and the sink's publishing connector, and a refusal turned into an error that says
//! what to fix (NATS3). Files are read again at every connect (NATS4).

use std::time::Duration;

use crate::config::nats::{read_certificates, read_creds, read_key, read_seed};
use crate::config::nats::{CredentialKind, NatsOptions, Tls};
use crate::config::opt;
use crate::error::{RelayError, Result, Target};

/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to NATS with the configured credential and TLS files (read now: NATS4).
pub async fn connect(options: &NatsOptions) -> Result<async_nats::Client> {
    let mut connect = async_nats::ConnectOptions::new()
        .name("outbox-relay")
        .connection_timeout(CONNECT_TIMEOUT)
        .custom_inbox_prefix(options.inbox_prefix.clone());
    if let Some(credential) = &options.credential {
        let unusable = |why: String| {
            RelayError::permanent(anyhow::anyhow!(
                "cannot use the NATS credentials of {}: {why}",
                credential.given_by
            ))
        };
        connect = match &credential.kind {
            CredentialKind::UserPassword { user, password } => {
                connect.user_and_password(user.clone(), password.expose().to_owned())
            }
            CredentialKind::Token(token) => connect.token(token.expose().to_owned()),
            CredentialKind::Nkey(path) => {
                connect.nkey(read_seed(path).map_err(unusable)?.expose().to_owned())
            }
            CredentialKind::Creds(path) => connect
                .credentials(read_creds(path).map_err(unusable)?.expose())
                .map_err(|e| unusable(e.to_string()))?,
        };
    }
    if let Some((ca, _)) = &options.tls.ca {
        connect = connect.add_root_certificates(ca.clone());
    }
    if let Some((cert, key, _)) = &options.tls.client {
        connect = connect.add_client_certificate(cert.clone(), key.clone());
    }
    if options.tls.required() {
        connect = connect.require_tls(true);
    }
    if options.tls.first {
        connect = connect.tls_first();
    }
    if options.no_randomize {
        connect = connect.retain_servers_order();
    }
    let servers: Vec<&str> = options.servers.iter().map(String::as_str).collect();
    connect.connect(servers).await.map_err(|error| {
        let message = format!("cannot connect to NATS at {options}: {error}");
        match refusal(options, &error) {
            Some(fix) => RelayError::permanent(anyhow::anyhow!("{message}: {fix}")),
            None => RelayError::transient(anyhow::anyhow!(message)),
        }
    })
}

/// Opens a session's publishing connection with `connector`, its replies under the client's
/// inbox prefix; a subscription the server forbids is an error that says which permission,
/// or which option, fixes it.
pub async fn open_publishing(
    connector: &sink::Connector,
    jetstream: &async_nats::jetstream::Context,
    config: &crate::config::Config,
) -> Result<sink::Connection> {
    connector
        .open(&jetstream.client(), config.max_in_flight)
        .await
        .map_err(|error| match error {
            sink::SinkError::Refused {
                kind: sink::Refusal::Authentication,
                ..
            } => RelayError::permanent(anyhow::anyhow!(
                "{error}: {}",
                auth_advice(&config.nats)
            ))
            .at(Target::Nats),
            sink::SinkError::SubscriptionRefused { .. } => RelayError::transient(anyhow::anyhow!(
                "{error}: give the NATS user subscribe permission on {prefix}.>, or set {} to a prefix it may subscribe to (then {{prefix}}.>)",
                opt::NATS_INBOX_PREFIX.how_to_set(),
                prefix = config.nats.inbox_prefix,
            ))
            .at(Target::Nats),
            // The sink's own conversion: transient, NATS's, the error kept whole.
            other => other.into(),
        })
}

/// The sink's publishing connection (`sink::conn`): the same servers, credential and TLS
/// files as [`connect`], read now (NATS4), so both connections present the same identity.
pub fn connector(options: &NatsOptions) -> Result<sink::Connector> {
    let unusable = |given_by: &str, why: String| {
        RelayError::permanent(anyhow::anyhow!(
            "cannot use the NATS credentials of {given_by}: {why}"
        ))
    };
    let auth = match &options.credential {
        None => sink::conn::Auth::None,
        Some(credential) => match &credential.kind {
            CredentialKind::UserPassword { user, password } => sink::conn::Auth::UserPassword {
                user: user.clone(),
                password: password.expose().to_owned(),
            },
            CredentialKind::Token(token) => sink::conn::Auth::Token(token.expose().to_owned()),
            CredentialKind::Nkey(path) => sink::conn::Auth::Nkey(
                read_seed(path)
                    .map_err(|why| unusable(&credential.given_by, why))?
                    .expose()
                    .to_owned(),
            ),
            CredentialKind::Creds(path) => {
                let text = read_creds(path).map_err(|why| unusable(&credential.given_by, why))?;
                let (jwt, seed) = split_creds(text.expose())
                    .map_err(|why| unusable(&credential.given_by, why))?;
                sink::conn::Auth::Jwt { jwt, seed }
            }
        },
    };
    let tls = if options.tls.ca.is_some() || options.tls.client.is_some() {
        Some(tls_config(&options.tls)?)
    } else {
        None
    };
    Ok(sink::Connector {
        servers: options.servers.clone(),
        auth,
        tls,
        tls_required: options.tls.required(),
        tls_first: options.tls.first,
        name: "outbox-relay-publisher".into(),
        timeout: CONNECT_TIMEOUT,
        ping_interval: sink::conn::PING_INTERVAL,
        randomize: !options.no_randomize,
        learned: options.learned.clone(),
    })
}

/// The TLS configuration of the options' CA and client certificate files, as async-nats
/// builds it: the CA file's certificates as roots (the system's when none is given), the
/// client certificate presented when given.
fn tls_config(tls: &Tls) -> Result<std::sync::Arc<rustls::ClientConfig>> {
    let unusable = |given_by: &str, why: String| {
        RelayError::permanent(anyhow::anyhow!("cannot use {given_by}: {why}"))
    };
    let mut roots = rustls::RootCertStore::empty();
    match &tls.ca {
        Some((path, given_by)) => {
            for certificate in read_certificates(path).map_err(|why| unusable(given_by, why))? {
                roots
                    .add(certificate)
                    .map_err(|e| unusable(given_by, format!("not a usable CA certificate: {e}")))?;
            }
        }
        None => {
            roots = sink::conn::system_roots().map_err(|why| {
                RelayError::permanent(anyhow::anyhow!("cannot set up TLS for NATS: {why}"))
            })?;
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| RelayError::permanent(anyhow::anyhow!("no usable TLS protocol version: {e}")))?
    .with_root_certificates(roots);
    let config = match &tls.client {
        Some((cert, key, given_by)) => {
            let chain = read_certificates(cert).map_err(|why| unusable(given_by, why))?;
            let key = read_key(key).map_err(|why| unusable(given_by, why))?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                unusable(
                    given_by,
                    format!("the key does not fit the certificate: {e}"),
                )
            })?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(std::sync::Arc::new(config))
}

/// The user JWT and nkey seed of a `.creds` file's text (checked by [`read_creds`]): the
/// first line after `-----BEGIN NATS USER JWT-----` and after `-----BEGIN USER NKEY SEED-----`.
fn split_creds(text: &str) -> Result<(String, String), String> {
    let after = |marker: &str| {
        let mut lines = text.lines().map(str::trim);
        lines.find(|line| line.contains(marker))?;
        lines.find(|line| !line.is_empty()).map(str::to_owned)
    };
    match (after("BEGIN NATS USER JWT"), after("BEGIN USER NKEY SEED")) {
        (Some(jwt), Some(seed)) => Ok((jwt, seed)),
        _ => Err("is not a NATS credentials file (user JWT and nkey seed)".into()),
    }
}

/// What to fix when `error` is a refusal retrying cannot cure (NATS3), naming the options.
/// What to do when the server refuses the credential (NATS3), on either connection.
fn auth_advice(options: &NatsOptions) -> String {
    match &options.credential {
        Some(credential) => format!(
            "the server refused the credentials of {}: check them (the server's log says why)",
            credential.given_by
        ),
        None => format!(
            "the server requires authentication: set {} and {}, or {}, {} or {}, or put user:password@ in {}",
            opt::NATS_USER.flag(),
            opt::NATS_PASSWORD.flag(),
            opt::NATS_TOKEN.flag(),
            opt::NATS_NKEY.flag(),
            opt::NATS_CREDS.flag(),
            opt::NATS_URL.env
        ),
    }
}

fn refusal(options: &NatsOptions, error: &async_nats::ConnectError) -> Option<String> {
    use async_nats::ConnectErrorKind as Kind;
    match error.kind() {
        Kind::Authentication | Kind::AuthorizationViolation => {
            return Some(auth_advice(options));
        }
        // Setting TLS up (reading the files, the server name) failed: not the network.
        Kind::Tls => {
            let given: Vec<&str> = [
                options.tls.ca.as_ref().map(|(_, by)| by.as_str()),
                options.tls.client.as_ref().map(|(_, _, by)| by.as_str()),
            ]
            .into_iter()
            .flatten()
            .collect();
            return Some(if given.is_empty() {
                format!(
                    "TLS cannot be set up with the system's roots: set {}",
                    opt::NATS_TLSCA.how_to_set()
                )
            } else {
                format!("TLS cannot be set up: check {}", given.join(" and "))
            });
        }
        _ => {}
    }
    match tls_error(error)? {
        rustls::Error::InvalidCertificate(_) => Some(match &options.tls.ca {
            Some((_, given_by)) => format!(
                "the server's certificate is not signed by the CA of {given_by} (or does not name the host): check it"
            ),
            None => format!(
                "the server's certificate is not signed by a CA of the system's roots: set {} to the CA that signed it",
                opt::NATS_TLSCA.how_to_set()
            ),
        }),
        rustls::Error::AlertReceived(alert) if is_certificate_alert(*alert) => {
            Some(match &options.tls.client {
                Some((_, _, given_by)) => format!(
                    "the server rejected the client certificate of {given_by}: check them (a certificate the server's CA signed, not expired, with its key)"
                ),
                None => format!(
                    "the server requires a client certificate: set {} and {}",
                    opt::NATS_TLSCERT.how_to_set(),
                    opt::NATS_TLSKEY.how_to_set()
                ),
            })
        }
        _ => None,
    }
}

/// An alert a server sends when it does not accept the client's certificate.
fn is_certificate_alert(alert: rustls::AlertDescription) -> bool {
    use rustls::AlertDescription as A;
    matches!(
        alert,
        A::BadCertificate
            | A::CertificateRequired
            | A::UnknownCA
            | A::CertificateUnknown
            | A::CertificateExpired
            | A::CertificateRevoked
            | A::UnsupportedCertificate
            | A::AccessDenied
    )
}

/// The TLS error in `error`'s chain, also inside an `io::Error` (whose `source` skips it).
fn tls_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(error);
    while let Some(error) = next {
        if let Some(tls) = error.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        let inner = error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .and_then(|inner| inner.downcast_ref::<rustls::Error>());
        if inner.is_some() {
            return inner;
        }
        next = error.source();
    }
    None
}
