//! NATS options: the configuration's servers, credential and TLS files, validated (their
//! connections are `crate::connect::nats`'s, which keeps NATS3, NATS4's reading at every connect
//! and NATS6).
//!
//! async-nats 0.51 never sends the user information of a server URL (nats.rs issue 1623):
//! the relay takes `user:password@` or `token@` out of every URL of `NATS_URL` itself,
//! percent-decoded, and hands async-nats the bare URLs plus one explicit credential. The
//! options carry the `nats` CLI's names: `--user`/`--password`, `--token`, `--nkey` (a file
//! holding a user nkey seed), `--creds` (a `.creds` file: user JWT and seed), `--tlsca`,
//! `--tlscert`/`--tlskey` and `--tlsfirst`; each is also an `OUTBOX_RELAY_NATS_*` variable
//! and a `nats_*` file key ([`crate::config::opt`]).
//!
//! # Invariants
//! - NATS1 Secrets never print: a password or token lives in a [`Secret`] (`Debug` and
//!   `Display` show `<redacted>`), seeds and keys stay in their files (only paths are kept),
//!   and URLs reach async-nats, which logs them, without their user information.
//! - NATS2 One credential for every server: async-nats sends the same credential to every
//!   server of the list (and to the servers they advertise), so the URLs that carry user
//!   information must all carry the same, and at most one source (the URLs, `--user` and
//!   `--password`, `--token`, `--nkey`, `--creds`) may be given; anything else is a
//!   configuration error, never a silent choice.
//! - NATS3 A credential or certificate the server refuses is a permanent error (retrying cannot
//!   help) whose message names the options to check as the operator gave them
//!   (`OUTBOX_RELAY_NATS_PASSWORD`, `--creds`, `nats_tlscert (in relay.toml)`…) and never a
//!   secret; every other connection failure is transient.
//! - NATS4 Files are checked when the configuration loads (a missing or malformed file stops
//!   the relay at start, exit 2) and read again at every connect, so a rotated file is used
//!   from the next session on. A seed, `.creds` or key file that group or others can read
//!   is named in a warning at start (`crate::config` CFG4).
//! - NATS5 Only `nats://` and `tls://` servers (or none) reach here: `crate::config` CFG3 refuses
//!   `ws://`/`wss://` and a list whose ',' may lie inside a credential.
//! - NATS6 Both connections dial the servers in a random order per connection unless
//!   `--no-randomize` (the `nats` CLI's name) says to keep the order given, and have
//!   distinct names in the server's monitoring: `outbox-relay` (async-nats: requests,
//!   stream management) and `outbox-relay-publisher` (`sink::conn`). The publishing
//!   connection's learned `connect_urls` and lame-duck server outlive a session (CN6). A
//!   credential the server refuses on the publishing connection is permanent with the same
//!   advice as on the control connection (NATS3).

use std::fmt;
use std::path::{Path, PathBuf};

use replication::Secret;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::{opt, parse_bool, ConfigError, NatsUrl, OptionSpec, RawConfig};

/// Where and how to connect: the validated NATS options of a [`crate::Config`].
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// The servers, without user information.
    pub(crate) servers: Vec<String>,
    /// The one credential (NATS2), if any.
    pub(crate) credential: Option<Credential>,
    /// TLS files and mode.
    pub(crate) tls: Tls,
    /// The prefix of the relay's reply subjects (`{prefix}.{unique}`).
    pub(crate) inbox_prefix: String,
    /// `--no-randomize`: dial the servers in the order given (NATS6).
    pub(crate) no_randomize: bool,
    /// What the publishing connections learned of the cluster, kept across sessions (NATS6).
    pub(crate) learned: std::sync::Arc<std::sync::Mutex<sink::conn::Learned>>,
}

/// A credential and the options it came from, as the operator gave them (NATS3).
#[derive(Debug, Clone)]
pub(crate) struct Credential {
    pub(crate) kind: CredentialKind,
    pub(crate) given_by: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CredentialKind {
    UserPassword { user: String, password: Secret },
    Token(Secret),
    Nkey(PathBuf),
    Creds(PathBuf),
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Tls {
    /// The CA file and the option that gave it.
    pub(crate) ca: Option<(PathBuf, String)>,
    /// The client certificate and key files and the options that gave them.
    pub(crate) client: Option<(PathBuf, PathBuf, String)>,
    pub(crate) first: bool,
}

impl Tls {
    pub(crate) fn required(&self) -> bool {
        self.ca.is_some() || self.client.is_some() || self.first
    }
}

impl NatsOptions {
    /// The password or token, for the log scrubber (`crate::observe::logging`); key and credentials
    /// files stay in their files.
    pub fn secrets(&self) -> Vec<String> {
        match self.credential.as_ref().map(|c| &c.kind) {
            Some(CredentialKind::UserPassword { password, .. }) => {
                vec![password.expose().to_owned()]
            }
            Some(CredentialKind::Token(token)) => vec![token.expose().to_owned()],
            _ => vec![],
        }
    }

    /// The servers, without user information.
    pub fn servers(&self) -> &[String] {
        &self.servers
    }

    /// The NATS user name, if the credential has one.
    pub(crate) fn user(&self) -> Option<&str> {
        match self.credential.as_ref().map(|c| &c.kind) {
            Some(CredentialKind::UserPassword { user, .. }) => Some(user),
            _ => None,
        }
    }

    /// The password or token, with what it is and where it came from (for the start-up
    /// warnings of `crate::config`, never printed).
    pub(crate) fn credential_secret(&self) -> Option<(String, &str)> {
        let credential = self.credential.as_ref()?;
        let (what, secret) = match &credential.kind {
            CredentialKind::UserPassword { password, .. } => ("password", password),
            CredentialKind::Token(token) => ("token", token),
            _ => return None,
        };
        Some((
            format!("the NATS {what} (of {})", credential.given_by),
            secret.expose(),
        ))
    }

    /// Where a password or token came from, when it would be sent to a server without
    /// verified TLS: a `nats://` (or scheme-less) URL, and no option that demands TLS
    /// (`--tlsca`, `--tlscert`, `--tlsfirst`). An nkey or `.creds` credential signs a
    /// challenge and reveals nothing.
    pub(crate) fn credential_in_clear(&self) -> Option<&str> {
        let credential = self.credential.as_ref()?;
        let revealing = matches!(
            credential.kind,
            CredentialKind::UserPassword { .. } | CredentialKind::Token(_)
        );
        let plain_server = self.servers.iter().any(|s| !s.starts_with("tls://"));
        (revealing && plain_server && !self.tls.required()).then_some(credential.given_by.as_str())
    }

    /// Validates the NATS options of `raw` (`url` already parsed): splits the URLs' user
    /// information off, enforces NATS2, and checks every file (NATS4).
    pub(crate) fn from_raw(raw: &RawConfig, url: &NatsUrl) -> Result<NatsOptions, ConfigError> {
        let url_name = raw
            .name(&opt::NATS_URL)
            .unwrap_or_else(|| opt::NATS_URL.flag());
        let (servers, from_url) = split_servers(url, &url_name)?;
        let credential = the_credential(raw, from_url, &url_name)?;
        let tls = tls_from(raw)?;
        Ok(NatsOptions {
            servers,
            credential,
            tls,
            inbox_prefix: raw.parse(&opt::NATS_INBOX_PREFIX, parse_inbox_prefix)?,
            no_randomize: raw.parse(&opt::NATS_NO_RANDOMIZE, parse_bool)?,
            learned: Default::default(),
        })
    }
}

/// The servers of `url` without their user information, and the one credential the user
/// information gives (NATS2: the same in every URL, or none).
fn split_servers(
    url: &NatsUrl,
    url_name: &str,
) -> Result<(Vec<String>, Option<CredentialKind>), ConfigError> {
    let mut servers = Vec::new();
    let mut from_url: Option<CredentialKind> = None;
    for server in url.expose().split(',') {
        let (bare, credential) = split_user_info(server.trim())
            .map_err(|why| ConfigError(format!("invalid {url_name}: {why}")))?;
        if let Some(credential) = credential {
            if from_url.as_ref().is_some_and(|seen| *seen != credential) {
                return Err(ConfigError(format!(
                    "{url_name} gives different credentials for different servers, but the relay sends one \
                     credential to every server: give the same user:password@ (or token@) in every URL, or use \
                     --user and --password, or --token (a ',' in a credential must be percent-encoded as %2C)"
                )));
            }
            from_url = Some(credential);
        }
        servers.push(bare);
    }

    Ok((servers, from_url))
}

/// The one NATS credential (NATS2): user and password, a token, an nkey seed file or a
/// `.creds` file (NATS4: each file checked), or the URLs' user information; more than one is
/// refused.
fn the_credential(
    raw: &RawConfig,
    from_url: Option<CredentialKind>,
    url_name: &str,
) -> Result<Option<Credential>, ConfigError> {
    let mut given = explicit_credentials(raw)?;
    if let Some(kind) = from_url {
        let what = match kind {
            CredentialKind::UserPassword { .. } => "user:password",
            _ => "token",
        };
        given.push(Credential {
            kind,
            given_by: format!("the {what} in {url_name}"),
        });
    }
    if given.len() > 1 {
        return Err(ConfigError(format!(
            "NATS credentials are given more than once ({}): give exactly one",
            given
                .iter()
                .map(|c| c.given_by.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }

    Ok(given.pop())
}

/// The credentials given by the options (not the URLs), in order: user and password, a
/// token, an nkey seed file, a `.creds` file (NATS4: each file checked).
fn explicit_credentials(raw: &RawConfig) -> Result<Vec<Credential>, ConfigError> {
    let name = |spec: &OptionSpec| raw.name(spec).unwrap_or_else(|| spec.flag());
    let text = |v: &str| {
        if v.is_empty() {
            Err("must not be empty".to_owned())
        } else {
            Ok(v.to_owned())
        }
    };
    let user = raw.parse_optional(&opt::NATS_USER, text)?;
    let password = raw.parse_optional(&opt::NATS_PASSWORD, text)?;
    let token = raw.parse_optional(&opt::NATS_TOKEN, text)?;
    let nkey = file_option(raw, &opt::NATS_NKEY, read_seed)?;
    let creds = file_option(raw, &opt::NATS_CREDS, read_creds)?;

    let mut given = Vec::new();
    if let Some((user, password)) = both(
        raw,
        (user, &opt::NATS_USER),
        (password, &opt::NATS_PASSWORD),
    )? {
        given.push(Credential {
            kind: CredentialKind::UserPassword {
                user,
                password: Secret::new(password),
            },
            given_by: format!(
                "{} and {}",
                name(&opt::NATS_USER),
                name(&opt::NATS_PASSWORD)
            ),
        });
    }
    let explicit = [
        (
            token.map(|t| CredentialKind::Token(Secret::new(t))),
            &opt::NATS_TOKEN,
        ),
        (nkey.map(CredentialKind::Nkey), &opt::NATS_NKEY),
        (creds.map(CredentialKind::Creds), &opt::NATS_CREDS),
    ];
    for (kind, spec) in explicit {
        if let Some(kind) = kind {
            given.push(Credential {
                kind,
                given_by: name(spec),
            });
        }
    }
    Ok(given)
}

/// An option naming a file, checked by `check` (NATS4).
fn file_option<T>(
    raw: &RawConfig,
    spec: &OptionSpec,
    check: impl Fn(&Path) -> Result<T, String>,
) -> Result<Option<PathBuf>, ConfigError> {
    raw.parse_optional(spec, |v| check(Path::new(v)).map(|_| PathBuf::from(v)))
}

/// The TLS options: the CA, the client certificate and its key (NATS4: each file checked,
/// the pair matching), TLS first.
fn tls_from(raw: &RawConfig) -> Result<Tls, ConfigError> {
    let name = |spec: &OptionSpec| raw.name(spec).unwrap_or_else(|| spec.flag());
    let ca = file_option(raw, &opt::NATS_TLSCA, read_certificates)?;
    let cert = file_option(raw, &opt::NATS_TLSCERT, read_certificates)?;
    let key = file_option(raw, &opt::NATS_TLSKEY, read_key)?;
    let client = match both(raw, (cert, &opt::NATS_TLSCERT), (key, &opt::NATS_TLSKEY))? {
        Some((cert, key)) => {
            let given_by = format!(
                "{} and {}",
                name(&opt::NATS_TLSCERT),
                name(&opt::NATS_TLSKEY)
            );
            check_key_pair(&cert, &key)
                .map_err(|why| ConfigError(format!("invalid {given_by}: {why}")))?;
            Some((cert, key, given_by))
        }
        None => None,
    };
    let tls = Tls {
        ca: ca.map(|ca| (ca, name(&opt::NATS_TLSCA))),
        client,
        first: raw.parse(&opt::NATS_TLSFIRST, parse_bool)?,
    };
    Ok(tls)
}

/// A subject prefix for replies: dot-separated tokens of printable ASCII without the
/// wildcards `*` and `>`, as the server requires of a subscription's literal part.
fn parse_inbox_prefix(text: &str) -> Result<String, String> {
    let valid_token = |token: &str| {
        !token.is_empty()
            && token
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'*' && b != b'>' && b != b'.')
    };
    if text.split('.').all(valid_token) {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?} is not a subject prefix: dot-separated tokens of printable ASCII without spaces, `*` or `>`, e.g. _INBOX_relay"
        ))
    }
}

/// Two options that only work together: both or neither is given.
fn both<A, B>(
    raw: &RawConfig,
    (a, a_spec): (Option<A>, &OptionSpec),
    (b, b_spec): (Option<B>, &OptionSpec),
) -> Result<Option<(A, B)>, ConfigError> {
    let missing = |given: &OptionSpec, missing: &OptionSpec| {
        ConfigError(format!(
            "{} is set without {}: set {}",
            raw.name(given).unwrap_or_else(|| given.flag()),
            missing.flag(),
            missing.how_to_set()
        ))
    };
    match (a, b) {
        (Some(a), Some(b)) => Ok(Some((a, b))),
        (Some(_), None) => Err(missing(a_spec, b_spec)),
        (None, Some(_)) => Err(missing(b_spec, a_spec)),
        (None, None) => Ok(None),
    }
}

/// The servers, comma-separated, without user information.
impl fmt::Display for NatsOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.servers.join(","))
    }
}

/// Splits `user:password@` or `token@` off a server URL: the bare URL and the credential,
/// percent-decoded. Errors never quote the user information.
fn split_user_info(server: &str) -> Result<(String, Option<CredentialKind>), String> {
    if server.is_empty() {
        return Err("a server URL is empty".into());
    }
    let (scheme, rest) = match server.find("://") {
        Some(i) => server.split_at(i + 3),
        None => ("", server),
    };
    let Some(at) = rest.rfind('@') else {
        return Ok((server.to_owned(), None));
    };
    let (info, host) = (&rest[..at], &rest[at + 1..]);
    if host.is_empty() {
        return Err("a server URL has user information but no host".into());
    }
    let decode = |part: &str, what: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(|_| format!("the {what} in a server URL is not UTF-8 once percent-decoded"))
    };
    let credential = match info.split_once(':') {
        Some((user, password)) => {
            let user = decode(user, "user")?;
            if user.is_empty() {
                return Err(
                    "a server URL has a password but no user name (user:password@host)".into(),
                );
            }
            CredentialKind::UserPassword {
                user,
                password: Secret::new(decode(password, "password")?),
            }
        }
        None => {
            let token = decode(info, "token")?;
            if token.is_empty() {
                return Err("a server URL has an empty token before its '@'".into());
            }
            CredentialKind::Token(Secret::new(token))
        }
    };
    Ok((format!("{scheme}{host}"), Some(credential)))
}

/// Reads the user nkey seed of an nkey file: the file may hold just the seed (as `nk -gen
/// user` writes it) or a decorated seed between `-----BEGIN…` lines. Errors never quote it.
pub(crate) fn read_seed(path: &Path) -> Result<Secret, String> {
    let text = read_file(path)?;
    let seed = text
        .lines()
        .map(str::trim)
        .find(|line| line.starts_with('S') && !line.contains(' '))
        .ok_or("holds no nkey seed (a line starting with SU)")?;
    let key_pair = nkeys::KeyPair::from_seed(seed)
        .map_err(|_| "holds no valid nkey seed (a line starting with SU)".to_owned())?;
    if key_pair.key_pair_type() != nkeys::KeyPairType::User {
        return Err(format!(
            "holds the seed of a {:?} key, not of a user (SU…)",
            key_pair.key_pair_type()
        ));
    }
    Ok(Secret::new(seed))
}

/// Reads a `.creds` file (user JWT and nkey seed), checked the way async-nats will use it.
pub(crate) fn read_creds(path: &Path) -> Result<Secret, String> {
    let text = read_file(path)?;
    async_nats::ConnectOptions::new()
        .credentials(&text)
        .map_err(|e| format!("is not a NATS credentials file (user JWT and nkey seed): {e}"))?;
    Ok(Secret::new(text))
}

/// Reads a PEM file holding at least one certificate.
pub(crate) fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("cannot read certificates from it: {e}"))?;
    if certificates.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    Ok(certificates)
}

/// Reads a PEM private key. Errors never quote it.
pub(crate) fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => {
            "holds no PEM private key (-----BEGIN PRIVATE KEY-----)".to_owned()
        }
        rustls_pki_types::pem::Error::Io(e) => format!("cannot read it: {e}"),
        _ => "holds no valid PEM private key".to_owned(),
    })
}

/// Checks that the key belongs to the certificate.
fn check_key_pair(cert: &Path, key: &Path) -> Result<(), String> {
    let provider = rustls::crypto::ring::default_provider();
    rustls::sign::CertifiedKey::from_der(read_certificates(cert)?, read_key(key)?, &provider)
        .map(drop)
        .map_err(|e| format!("the key does not fit the certificate: {e}"))
}

fn read_file(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read it: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::load;

    const DB: (&str, &str) = ("DATABASE_URL", "postgres://relay:pw@db/app");

    fn nats(env: &[(&str, &str)]) -> Result<NatsOptions, ConfigError> {
        let mut all = vec![DB];
        all.extend_from_slice(env);
        load(&[], &all, None).map(|config| config.nats)
    }

    #[test]
    fn user_information_of_every_url_is_taken_out_and_decoded() {
        let options = nats(&[(
            "NATS_URL",
            "nats://relay:s%40cr%3At@a:4222, nats://b:4222,tls://relay:s%40cr%3At@c",
        )])
        .unwrap();
        assert_eq!(
            options.servers,
            ["nats://a:4222", "nats://b:4222", "tls://c"]
        );
        let credential = options.credential.unwrap();
        assert_eq!(
            credential.kind,
            CredentialKind::UserPassword {
                user: "relay".into(),
                password: Secret::new("s@cr:t")
            }
        );
        assert_eq!(credential.given_by, "the user:password in NATS_URL");

        let options = nats(&[("NATS_URL", "tok3n@host:4222")]).unwrap();
        assert_eq!(options.servers, ["host:4222"]);
        assert_eq!(
            options.credential.unwrap().kind,
            CredentialKind::Token(Secret::new("tok3n"))
        );
    }

    #[test]
    fn different_credentials_per_server_are_refused() {
        let e = nats(&[("NATS_URL", "nats://a:x@h1,nats://a:y@h2")]).unwrap_err();
        assert!(e.0.contains("different credentials"), "{e}");
        assert!(!e.0.contains(":x@") && !e.0.contains(":y@"), "{e}");
    }

    #[test]
    fn two_credential_sources_are_refused_naming_both() {
        let e = nats(&[
            ("NATS_URL", "nats://tok@h"),
            ("OUTBOX_RELAY_NATS_TOKEN", "other"),
        ])
        .unwrap_err();
        assert!(
            e.0.contains("OUTBOX_RELAY_NATS_TOKEN") && e.0.contains("the token in NATS_URL"),
            "{e}"
        );
        assert!(!e.0.contains("other") && !e.0.contains("tok@"), "{e}");
        let e = nats(&[("OUTBOX_RELAY_NATS_USER", "relay")]).unwrap_err();
        assert!(e.0.contains("--password"), "{e}");
    }

    #[test]
    fn missing_and_malformed_files_name_the_option() {
        let e = nats(&[("OUTBOX_RELAY_NATS_CREDS", "/nonexistent/relay.creds")]).unwrap_err();
        assert!(
            e.0.contains("invalid OUTBOX_RELAY_NATS_CREDS") && e.0.contains("cannot read it"),
            "{e}"
        );
        let dir = tempfile::tempdir().unwrap();
        let seed = dir.path().join("seed");
        std::fs::write(&seed, "SXnotaseed\n").unwrap();
        let e = nats(&[("OUTBOX_RELAY_NATS_NKEY", seed.to_str().unwrap())]).unwrap_err();
        assert!(e.0.contains("no valid nkey seed"), "{e}");
        assert!(!e.0.contains("SXnotaseed"), "{e}");
        let e = nats(&[("OUTBOX_RELAY_NATS_TLSCERT", seed.to_str().unwrap())]).unwrap_err();
        assert!(e.0.contains("OUTBOX_RELAY_NATS_TLSCERT"), "{e}");
    }

    #[test]
    fn file_keys_and_booleans_set_tls() {
        let options = load(
            &[],
            &[DB],
            Some("nats_tlsfirst = true\nnats_url = \"tls://h:4222\"\n"),
        )
        .unwrap()
        .nats;
        assert!(options.tls.first && options.tls.required());
        assert_eq!(options.servers, ["tls://h:4222"]);
    }

    #[test]
    fn the_inbox_prefix_is_a_literal_subject_prefix() {
        assert_eq!(nats(&[]).unwrap().inbox_prefix, "_INBOX");
        let given = nats(&[("OUTBOX_RELAY_NATS_INBOX_PREFIX", "_INBOX_relay.orders")]).unwrap();
        assert_eq!(given.inbox_prefix, "_INBOX_relay.orders");
        for bad in [
            "", "a..b", "a.", ".a", "a b", "_INBOX.*", "_INBOX.>", "a\tb",
        ] {
            let error = nats(&[("OUTBOX_RELAY_NATS_INBOX_PREFIX", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                error.contains("OUTBOX_RELAY_NATS_INBOX_PREFIX")
                    && error.contains("not a subject prefix"),
                "{bad:?}: {error}"
            );
        }
    }

    #[test]
    fn secrets_never_print() {
        let options = nats(&[
            ("NATS_URL", "nats://h"),
            ("OUTBOX_RELAY_NATS_USER", "relay"),
            ("OUTBOX_RELAY_NATS_PASSWORD", "hunter2"),
        ])
        .unwrap();
        let shown = format!("{options:?} {options}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let options = nats(&[("NATS_URL", "nats://relay:hunter2@h,nats://tok3n@h2")]);
        let shown = format!("{options:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok3n"),
            "{shown}"
        );
    }
}
