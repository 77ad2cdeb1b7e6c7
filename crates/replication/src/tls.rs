//! TLS with libpq's `sslmode` semantics, on rustls with the ring provider.
//!
//! | sslmode | server without TLS | certificate check |
//! |---|---|---|
//! | `disable` | plaintext | TLS is never tried |
//! | `prefer` | plaintext | like `require` |
//! | `require` | error | none, or the chain (like `verify-ca`) when a root certificate is available |
//! | `verify-ca` | error | chain to a trusted root; the host name is not checked |
//! | `verify-full` | error | chain to a trusted root and the host name |
//!
//! The trusted roots are the PEM file `sslrootcert`, else `~/.postgresql/root.crt` if that
//! exists (libpq's default), or with `sslrootcert=system` the system's trust store
//! (rustls-native-certs: the OS certificate bundle, or `SSL_CERT_FILE`/`SSL_CERT_DIR`).
//! `verify-ca` and `verify-full` without roots are a configuration error. Unlike libpq, an
//! explicitly given `sslrootcert` that cannot be read is an error in every mode: silently
//! dropping verification the operator asked for is worse than failing. Also unlike libpq,
//! `prefer` does not retry in plaintext after a failed TLS handshake.
//!
//! A client certificate (`sslcert`, a PEM chain, with its key `sslkey`: PKCS#8, PKCS#1 or
//! SEC1 PEM, unencrypted) is presented when the server asks for one (`hostssl ... cert`, or
//! `clientcert=verify-ca/verify-full` in pg_hba.conf). As in libpq, the key file must not be
//! accessible by group or others (0600), except that a key owned by root may be
//! group-readable (0640); an explicitly given `sslcert` that cannot be read is an error
//! (libpq would silently connect without it).
//!
//! "Verify nothing" still verifies the handshake signatures, so the peer must hold the key
//! of the certificate it presents; that is what makes `tls-server-end-point` channel binding
//! (SCRAM-SHA-256-PLUS) meaningful even when the chain is not checked.
//!
//! The crypto provider is always passed explicitly
//! (`ClientConfig::builder_with_provider`), never taken from a process-wide default, so the
//! relay works whatever other crates install.
//!
//! Both connections run their TLS through `connection::open`: the replication
//! connection and [`crate::connect_sql`]'s control connection.

use std::io;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use sha2::Digest;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::conninfo::{ConnInfo, RootCerts, SslMode};
use crate::Error;

/// The ring provider, created per configuration rather than installed process-wide.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The rustls client configuration for `info`'s `sslmode` and root certificates.
///
/// Errors (permanent): `verify-ca`/`verify-full` without a root certificate, an unreadable
/// or empty `sslrootcert`, an empty system trust store, an unreadable client certificate or
/// key, a key file others can read.
pub fn client_config(info: &ConnInfo) -> Result<Arc<ClientConfig>, Error> {
    let provider = provider();
    let mode = info.sslmode();
    let roots = match mode {
        SslMode::Disable => None,
        _ => load_roots(info)?,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (mode, roots) {
        (SslMode::VerifyFull, Some(roots)) => webpki_verifier(roots, &provider)?,
        (SslMode::Prefer | SslMode::Require | SslMode::VerifyCa, Some(roots)) => {
            Arc::new(Lenient {
                chain: Some(webpki_verifier(roots, &provider)?),
                algorithms: provider.signature_verification_algorithms,
            })
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(Error::TlsConfig(format!(
                "sslmode={mode} needs a root certificate: set sslrootcert=/path/to/ca.crt"
            )))
        }
        (SslMode::Disable, _) | (SslMode::Prefer | SslMode::Require, None) => Arc::new(Lenient {
            chain: None,
            algorithms: provider.signature_verification_algorithms,
        }),
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::TlsConfig(format!("no usable TLS protocol version: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match client_certificate(info)? {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).map_err(|e| {
            Error::TlsConfig(format!(
                "the client certificate (sslcert) and key (sslkey) do not fit together: {e}"
            ))
        })?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

fn webpki_verifier(
    roots: RootCertStore,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, Error> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| Error::TlsConfig(format!("cannot build the certificate verifier: {e}")))
}

/// The trusted roots of [`ConnInfo::root_certs`], if any.
fn load_roots(info: &ConnInfo) -> Result<Option<RootCertStore>, Error> {
    let path = match info.root_certs() {
        None => return Ok(None),
        Some(RootCerts::System) => return system_roots().map(Some),
        Some(RootCerts::File(path)) => path,
    };
    let mut roots = RootCertStore::empty();
    let certificates = CertificateDer::pem_file_iter(path).map_err(|e| {
        Error::TlsConfig(format!(
            "cannot read root certificate file {}: {e}",
            path.display()
        ))
    })?;
    for certificate in certificates {
        let certificate = certificate.map_err(|e| {
            Error::TlsConfig(format!(
                "cannot read root certificate file {}: {e}",
                path.display()
            ))
        })?;
        roots.add(certificate).map_err(|e| {
            Error::TlsConfig(format!(
                "unusable root certificate in {}: {e}",
                path.display()
            ))
        })?;
    }
    if roots.is_empty() {
        return Err(Error::TlsConfig(format!(
            "no certificate in root certificate file {}",
            path.display()
        )));
    }
    Ok(Some(roots))
}

/// `sslrootcert=system`: the platform's trusted roots.
fn system_roots() -> Result<RootCertStore, Error> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let errors: Vec<String> = found.errors.iter().map(ToString::to_string).collect();
        return Err(Error::TlsConfig(format!(
            "sslrootcert=system, but no trusted root certificate was found on this system{}; \
             install the ca-certificates package, set SSL_CERT_FILE, or point sslrootcert at a \
             CA file",
            if errors.is_empty() {
                String::new()
            } else {
                format!(" ({})", errors.join("; "))
            }
        )));
    }
    Ok(roots)
}

/// The client certificate chain and key, when there is a certificate.
fn client_certificate(
    info: &ConnInfo,
) -> Result<Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>, Error> {
    let Some(cert_path) = info.sslcert() else {
        return Ok(None);
    };
    let unreadable = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
        Error::TlsConfig(format!("cannot read {what} {}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_file_iter(cert_path)
        .map_err(|e| unreadable("client certificate file (sslcert)", cert_path, &e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| unreadable("client certificate file (sslcert)", cert_path, &e))?;
    if chain.is_empty() {
        return Err(Error::TlsConfig(format!(
            "no certificate in client certificate file (sslcert) {}",
            cert_path.display()
        )));
    }
    let key_path = info.sslkey().ok_or_else(|| {
        Error::TlsConfig(format!(
            "client certificate {} has no key: set sslkey=/path/to/client.key",
            cert_path.display()
        ))
    })?;
    std::fs::metadata(key_path)
        .map_err(|e| unreadable("private key file (sslkey)", key_path, &e))?;
    // libpq's rule: u=rw (0600) or less, u=rw,g=r (0640) when root owns it.
    if let Some(exposed) =
        crate::conninfo::exposed_secret_file(key_path, "private key file (sslkey)", true)
    {
        return Err(Error::TlsConfig(exposed));
    }
    let key = PrivateKeyDer::from_pem_file(key_path).map_err(|e| {
        Error::TlsConfig(format!(
            "no usable private key in {} ({e}); encrypted keys (sslpassword) are not supported: \
             decrypt it with `openssl pkey -in key -out key.plain`",
            key_path.display()
        ))
    })?;
    Ok(Some((chain, key)))
}

/// The name the certificate must carry for `verify-full` (a DNS name or an IP address).
pub(crate) fn server_name(host: &str) -> Result<ServerName<'static>, Error> {
    ServerName::try_from(host.to_owned()).map_err(|_| {
        Error::TlsConfig(format!(
            "host {host:?} is neither a DNS name nor an IP address usable for TLS"
        ))
    })
}

/// Runs the TLS handshake on an established stream (after the server answered 'S' to the
/// SSLRequest). A failure reported by rustls becomes [`Error::TlsHandshake`].
pub(crate) async fn handshake<S>(
    config: Arc<ClientConfig>,
    host: &str,
    stream: S,
    target: &str,
) -> Result<tokio_rustls::client::TlsStream<S>, Error>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let name = server_name(host)?;
    tokio_rustls::TlsConnector::from(config)
        .connect(name, stream)
        .await
        .map_err(|error| handshake_error(error, target))
}

fn handshake_error(error: io::Error, target: &str) -> Error {
    match error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => Error::TlsHandshake {
            target: target.to_owned(),
            source: tls.clone(),
        },
        None => Error::io(format!("tls handshake with {target}"), error),
    }
}

/// The `tls-server-end-point` channel binding data (RFC 5929 §4.1) of the server's
/// certificate: its hash with the hash function of its signature algorithm, SHA-256 for MD5
/// and SHA-1. `None` for algorithms without a single hash function (Ed25519, RSA-PSS) and
/// for undecodable certificates; the caller then does not offer channel binding.
pub(crate) fn tls_server_end_point(certificate: &[u8]) -> Option<Vec<u8>> {
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signatureValue }
    let (tag, certificate_body, _) = der_element(certificate)?;
    if tag != 0x30 {
        return None;
    }
    let (_tbs_tag, _tbs, rest) = der_element(certificate_body)?;
    let (tag, algorithm, _) = der_element(rest)?;
    if tag != 0x30 {
        return None;
    }
    let (tag, oid, _) = der_element(algorithm)?;
    if tag != 0x06 {
        return None;
    }
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    let hash: fn(&[u8]) -> Vec<u8> = match oid {
        // md5WithRSAEncryption, sha1WithRSAEncryption, sha256WithRSAEncryption
        [prefix @ .., 0x04 | 0x05 | 0x0b] if prefix == RSA => |c| sha2::Sha256::digest(c).to_vec(),
        [prefix @ .., 0x0c] if prefix == RSA => |c| sha2::Sha384::digest(c).to_vec(),
        [prefix @ .., 0x0d] if prefix == RSA => |c| sha2::Sha512::digest(c).to_vec(),
        [prefix @ .., 0x0e] if prefix == RSA => |c| sha2::Sha224::digest(c).to_vec(),
        _ if oid == ECDSA_SHA1 => |c| sha2::Sha256::digest(c).to_vec(),
        [prefix @ .., 0x01] if prefix == ECDSA_SHA2 => |c| sha2::Sha224::digest(c).to_vec(),
        [prefix @ .., 0x02] if prefix == ECDSA_SHA2 => |c| sha2::Sha256::digest(c).to_vec(),
        [prefix @ .., 0x03] if prefix == ECDSA_SHA2 => |c| sha2::Sha384::digest(c).to_vec(),
        [prefix @ .., 0x04] if prefix == ECDSA_SHA2 => |c| sha2::Sha512::digest(c).to_vec(),
        _ => return None,
    };
    Some(hash(certificate))
}

/// One DER element: `(tag, content, rest)`; `None` when truncated or malformed.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (length, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let count = usize::from(first & 0x7f);
        if count == 0 || count > 4 {
            return None;
        }
        let (bytes, rest) = rest.split_at_checked(count)?;
        let length = bytes
            .iter()
            .fold(0usize, |acc, byte| (acc << 8) | usize::from(*byte));
        (length, rest)
    };
    let (content, rest) = rest.split_at_checked(length)?;
    Some((tag, content, rest))
}

/// The modes that check less than `verify-full`. With `chain` (`verify-ca`, or `prefer` and
/// `require` with roots): the full WebPKI check, except that a certificate valid for another
/// name is accepted; rustls checks the name only after the chain, so this error implies a
/// good chain. Without (`prefer` and `require` without roots): any certificate. Either way
/// the handshake signatures must verify, with the algorithms the chain's verifier uses too.
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<WebPkiServerVerifier>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn info(text: &str) -> ConnInfo {
        ConnInfo::parse_with_env(text, |_| None).unwrap()
    }

    #[test]
    fn verify_modes_need_a_root_certificate() {
        // Parsed without HOME, so ~/.postgresql/root.crt is out of the picture.
        for mode in ["verify-ca", "verify-full"] {
            let error = client_config(&info(&format!("host=h sslmode={mode}"))).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "tls configuration: sslmode={mode} needs a root certificate: \
                     set sslrootcert=/path/to/ca.crt"
                )
            );
            assert!(!error.is_transient());
        }
        for mode in ["prefer", "require"] {
            client_config(&info(&format!("host=h sslmode={mode}"))).unwrap();
        }
    }

    #[test]
    fn unreadable_root_certificate_is_an_error_in_every_mode() {
        for mode in ["prefer", "require", "verify-ca", "verify-full"] {
            let error = client_config(&info(&format!(
                "host=h sslmode={mode} sslrootcert=/nonexistent/ca.crt"
            )))
            .unwrap_err();
            assert!(error.to_string().contains("/nonexistent/ca.crt"), "{error}");
            assert!(!error.is_transient());
        }
    }

    #[test]
    fn system_roots_load_for_sslrootcert_system() {
        let config = client_config(&info("host=h sslrootcert=system"));
        assert!(config.is_ok(), "{:?}", config.err());
    }

    #[test]
    fn client_certificate_files_are_checked() {
        let scratch = testkit::scratch_dir("client-cert");
        let dir = scratch.path();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["relay".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert_path, key_path) = (dir.join("client.crt"), dir.join("client.key"));
        testkit::write_file_mode(&cert_path, &cert.pem(), 0o644);
        testkit::write_file_mode(&key_path, &key.serialize_pem(), 0o600);
        let conninfo = format!(
            "host=h sslmode=require sslcert={} sslkey={}",
            cert_path.display(),
            key_path.display()
        );
        let set_mode = |mode: u32| {
            std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        set_mode(0o600);
        client_config(&info(&conninfo)).unwrap();
        set_mode(0o604);
        let error = client_config(&info(&conninfo)).unwrap_err();
        assert!(
            error.to_string().contains("group or world access") && !error.is_transient(),
            "{error}"
        );
        set_mode(0o600);
        let error = client_config(&info(&format!(
            "host=h sslcert={} sslkey=/nonexistent/client.key",
            cert_path.display()
        )))
        .unwrap_err();
        assert!(error.to_string().contains("sslkey"), "{error}");
        let error = client_config(&info("host=h sslcert=/nonexistent/client.crt")).unwrap_err();
        assert!(
            error.to_string().contains("/nonexistent/client.crt") && !error.is_transient(),
            "{error}"
        );
        let error =
            client_config(&info(&format!("host=h sslcert={}", cert_path.display()))).unwrap_err();
        assert!(error.to_string().contains("set sslkey="), "{error}");
    }

    #[test]
    fn server_names() {
        assert!(server_name("localhost").is_ok());
        assert!(server_name("127.0.0.1").is_ok());
        assert!(server_name("::1").is_ok());
        assert!(server_name("bad host").is_err());
    }

    #[test]
    fn der_walk_is_total() {
        assert_eq!(der_element(&[]), None);
        assert_eq!(der_element(&[0x30]), None);
        assert_eq!(der_element(&[0x30, 0x05, 0x01]), None);
        assert_eq!(der_element(&[0x30, 0x80]), None);
        assert_eq!(der_element(&[0x30, 0x85, 1, 1, 1, 1, 1]), None);
        assert_eq!(
            der_element(&[0x04, 0x81, 0x01, 0xaa, 0xbb]),
            Some((0x04, &[0xaa][..], &[0xbb][..]))
        );
        for length in 0..40 {
            let junk: Vec<u8> = (0..length).map(|i| (i * 37 % 256) as u8).collect();
            let _ = tls_server_end_point(&junk);
        }
    }

    #[test]
    fn end_point_hash_follows_the_signature_algorithm() {
        // A skeleton certificate: SEQUENCE { SEQUENCE {} (tbs), SEQUENCE { OID }, BIT STRING }.
        fn skeleton(oid: &[u8]) -> Vec<u8> {
            let mut algorithm = vec![0x06, oid.len() as u8];
            algorithm.extend_from_slice(oid);
            let mut body = vec![0x30, 0x00, 0x30, algorithm.len() as u8];
            body.extend_from_slice(&algorithm);
            body.extend_from_slice(&[0x03, 0x01, 0x00]);
            let mut certificate = vec![0x30, body.len() as u8];
            certificate.extend_from_slice(&body);
            certificate
        }
        let ecdsa_sha256 = skeleton(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, 0x02]);
        assert_eq!(
            tls_server_end_point(&ecdsa_sha256),
            Some(sha2::Sha256::digest(&ecdsa_sha256).to_vec())
        );
        let rsa_sha384 = skeleton(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0c]);
        assert_eq!(
            tls_server_end_point(&rsa_sha384),
            Some(sha2::Sha384::digest(&rsa_sha384).to_vec())
        );
        let rsa_sha1 = skeleton(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x05]);
        assert_eq!(
            tls_server_end_point(&rsa_sha1),
            Some(sha2::Sha256::digest(&rsa_sha1).to_vec())
        );
        let ed25519 = skeleton(&[0x2b, 0x65, 0x70]);
        assert_eq!(tls_server_end_point(&ed25519), None);
    }
}
