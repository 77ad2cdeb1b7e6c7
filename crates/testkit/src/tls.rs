//! Throwaway PKI: a CA and a server certificate for `localhost` / 127.0.0.1.

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
    let ca_key = KeyPair::generate().expect("testkit: generate CA key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("testkit: CA params");
    ca_params
        .distinguished_name
        .push(DnType::CommonName, unique_ca_name());
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params
        .self_signed(&ca_key)
        .expect("testkit: self-sign CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);

    let server_key = KeyPair::generate().expect("testkit: generate server key");
    let mut params = CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .expect("testkit: server certificate params");
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = params
        .signed_by(&server_key, &issuer)
        .expect("testkit: sign server certificate");

    let files = ServerTls {
        ca_cert: dir.join("ca.crt"),
        server_cert: dir.join("server.crt"),
        server_key: dir.join("server.key"),
    };
    write_file(&files.ca_cert, &ca_cert.pem(), 0o644);
    write_file(&files.server_cert, &server_cert.pem(), 0o644);
    write_file(&files.server_key, &server_key.serialize_pem(), 0o600);
    files
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
