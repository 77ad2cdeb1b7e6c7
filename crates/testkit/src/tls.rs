//! Throwaway PKI: a CA ([`Ca`]), server certificates for `localhost` / 127.0.0.1 and
//! client certificates.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

#[derive(Debug, Clone)]
pub(crate) struct ServerTls {
    pub(crate) ca_cert: PathBuf,
    pub(crate) server_cert: PathBuf,
    pub(crate) server_key: PathBuf,
}

/// Write `ca.crt`, `server.crt` and `server.key` (mode 0600) into `dir`;
/// all three are chowned to the server user.
pub(crate) fn write_server_tls(dir: &Path) -> ServerTls {
    let ca = Ca::new();
    let ca_cert = dir.join("ca.crt");
    ca.write_cert(&ca_cert);
    let (server_cert, server_key) = ca.write_server(dir, "server");
    ServerTls {
        ca_cert,
        server_cert,
        server_key,
    }
}

/// A throwaway certificate authority that issues server certificates for `localhost` /
/// 127.0.0.1 and client certificates. Files it writes are chowned to the server user
/// (keys mode 0600).
pub struct Ca {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ca")
    }
}

impl Default for Ca {
    fn default() -> Self {
        Self::new()
    }
}

impl Ca {
    /// A new CA with a name of its own (see [`unique_ca_name`]).
    pub fn new() -> Ca {
        let ca_key = KeyPair::generate().expect("testkit: generate CA key");
        let mut ca_params =
            CertificateParams::new(Vec::<String>::new()).expect("testkit: CA params");
        ca_params
            .distinguished_name
            .push(DnType::CommonName, unique_ca_name());
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert_pem = ca_params
            .self_signed(&ca_key)
            .expect("testkit: self-sign CA certificate")
            .pem();
        Ca {
            cert_pem,
            issuer: Issuer::new(ca_params, ca_key),
        }
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Writes the CA certificate to `path` (mode 0644).
    pub fn write_cert(&self, path: &Path) {
        write_file(path, &self.cert_pem, 0o644);
    }

    /// Writes `{stem}.crt` and `{stem}.key`: a server certificate for `localhost` and
    /// 127.0.0.1. Returns (certificate, key).
    pub fn write_server(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("testkit: server certificate params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.write_issued(params, dir, stem)
    }

    /// Writes `{stem}.crt` and `{stem}.key`: a client certificate with common name
    /// `common_name`. Returns (certificate, key).
    pub fn write_client(&self, dir: &Path, stem: &str, common_name: &str) -> (PathBuf, PathBuf) {
        let mut params = CertificateParams::new(Vec::<String>::new())
            .expect("testkit: client certificate params");
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.write_issued(params, dir, stem)
    }

    fn write_issued(
        &self,
        mut params: CertificateParams,
        dir: &Path,
        stem: &str,
    ) -> (PathBuf, PathBuf) {
        params.is_ca = IsCa::ExplicitNoCa;
        let key = KeyPair::generate().expect("testkit: generate a key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("testkit: sign a certificate");
        let cert_path = dir.join(format!("{stem}.crt"));
        let key_path = dir.join(format!("{stem}.key"));
        write_file(&cert_path, &cert.pem(), 0o644);
        write_file(&key_path, &key.serialize_pem(), 0o600);
        (cert_path, key_path)
    }
}

fn write_file(path: &Path, contents: &str, mode: u32) {
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .unwrap_or_else(|e| panic!("testkit: create {}: {e}", path.display()));
    file.write_all(contents.as_bytes())
        .unwrap_or_else(|e| panic!("testkit: write {}: {e}", path.display()));
    crate::chown_to_server(path);
}

/// CAs with identical names confuse certificate path building (a client
/// trusting another instance's CA would fail with an obscure signature error
/// instead of "certificate verify failed"), so every CA gets its own name.
fn unique_ca_name() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "testkit CA {}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}
