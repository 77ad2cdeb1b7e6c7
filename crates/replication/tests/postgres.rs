//! The replication transport against real PostgreSQL 15 servers (testkit).
//!
//! Servers: one SCRAM + TLS server shared by most tests (each test uses its own database,
//! slot and publication), one MD5 server, and a private trust server for the crash test.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use replication::{
    connect_sql, pg_timestamp, publication_names, reply_requested, status_interval, ConnInfo,
    Error, Feedback, Lsn, ReplicationConnection, ReplicationMessage, ReplicationStream,
    StandbyStatusUpdate,
};
use testkit::{PgAuth, PgOptions, Postgres};
use tokio::time::{sleep, sleep_until, timeout, Instant};

const PASSWORD: &str = "Sup3r-s3cret'pw";
const WRONG_PASSWORD: &str = "Wr0ng-pa55word-7f3a";

static SCRAM_TLS: OnceLock<Postgres> = OnceLock::new();
static MD5: OnceLock<Postgres> = OnceLock::new();

fn scram_tls() -> &'static Postgres {
    shared_with_password(&SCRAM_TLS, PgAuth::Scram, true)
}

fn md5() -> &'static Postgres {
    shared_with_password(&MD5, PgAuth::Md5, false)
}

/// The server in `cell`, started on first use with `auth` and [`PASSWORD`].
fn shared_with_password(
    cell: &'static OnceLock<Postgres>,
    auth: PgAuth,
    tls: bool,
) -> &'static Postgres {
    testkit::shared(cell, || {
        Postgres::start_with(PgOptions {
            auth,
            password: Some(PASSWORD.to_owned()),
            tls,
            settings: vec![],
            bin_dir: None,
        })
    })
}

/// Parses key=value conninfo without looking at the environment (PGPASSWORD, PGUSER).
fn conninfo(text: &str) -> ConnInfo {
    ConnInfo::parse_with_env(text, |_| None).expect("valid conninfo")
}

fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// host=127.0.0.1 port=... user=postgres password=PASSWORD dbname=... plus `extra`.
fn tcp(pg: &Postgres, db: &str, extra: &str) -> ConnInfo {
    conninfo(&format!(
        "host=127.0.0.1 port={} user=postgres password={} dbname={} connect_timeout=10 {extra}",
        pg.port(),
        quote(PASSWORD),
        quote(db)
    ))
}

fn ca(pg: &Postgres) -> String {
    quote(
        &pg.ca_cert_path()
            .expect("server has TLS")
            .display()
            .to_string(),
    )
}

fn unrelated_ca() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/unrelated-ca.crt");
    quote(&path.display().to_string())
}

/// The error connecting to `pg` in `sslmode` with [`unrelated_ca`] as the root.
async fn refused_by_an_unrelated_ca(pg: &Postgres, sslmode: &str) -> Error {
    let options = format!("sslmode={sslmode} sslrootcert={}", unrelated_ca());
    ReplicationConnection::connect(&tcp(pg, "postgres", &options))
        .await
        .expect_err("a root that did not sign the server's certificate")
}

/// A database with an outbox table, a publication `pub` and a pgoutput slot per name in
/// `slots`.
fn outbox_database(pg: &Postgres, db: &str, slots: &[&str]) {
    pg.create_database(db);
    let mut sql = String::from(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text NOT NULL);\n\
         CREATE PUBLICATION pub FOR TABLE outbox;\n",
    );
    for slot in slots {
        sql.push_str(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');\n"
        ));
    }
    pg.psql(db, &sql);
}

async fn start(info: &ConnInfo, slot: &str) -> ReplicationStream {
    let names = publication_names(&["pub"]);
    ReplicationConnection::connect(info)
        .await
        .expect("connect")
        .start_logical_replication(
            slot,
            Lsn::ZERO,
            &[("proto_version", "1"), ("publication_names", &names)],
        )
        .await
        .expect("start replication")
}

/// Receives one transaction: the pgoutput messages from Begin to Commit, and the commit's
/// end LSN. Keepalives are skipped.
async fn recv_transaction(stream: &mut ReplicationStream) -> (Vec<u8>, Lsn) {
    let mut tags = Vec::new();
    loop {
        let message = timeout(Duration::from_secs(10), stream.recv())
            .await
            .expect("a transaction within 10 s")
            .expect("recv");
        let ReplicationMessage::XLogData(xlog) = message else {
            continue;
        };
        let tag = xlog.data[0];
        if tags.is_empty() {
            assert_eq!(tag, b'B', "a transaction starts with Begin");
        }
        tags.push(tag);
        if tag == b'C' {
            // Commit: flags (1), commit_lsn (8), end_lsn (8), timestamp (8).
            assert_eq!(xlog.data.len(), 1 + 1 + 8 + 8 + 8);
            let end = u64::from_be_bytes(xlog.data[10..18].try_into().expect("8 bytes"));
            return (tags, Lsn(end));
        }
    }
}

fn assert_no_password(error: &Error) {
    let shown = format!("{error} {error:?}");
    for secret in [PASSWORD, WRONG_PASSWORD] {
        assert!(!shown.contains(secret), "password leaked: {shown}");
    }
}

#[tokio::test]
async fn scram_without_tls_right_and_wrong_password() {
    let pg = scram_tls();
    let info = tcp(pg, "postgres", "sslmode=disable");
    let mut connection = ReplicationConnection::connect(&info)
        .await
        .expect("connect");
    assert!(!connection.is_tls());
    assert_eq!(connection.sasl_mechanism(), Some("SCRAM-SHA-256"));
    assert!(connection.server_version_num().expect("server_version") >= 150_000);
    assert_eq!(connection.parameter("TimeZone"), Some("UTC"));
    let system = connection.identify_system().await.expect("IDENTIFY_SYSTEM");
    assert_eq!(system.dbname.as_deref(), Some("postgres"));
    assert_eq!(system.timeline, 1);
    assert!(system.xlogpos > Lsn::ZERO);
    assert!(!system.systemid.is_empty());
    connection.close().await.expect("close");

    let info = conninfo(&format!(
        "postgres://postgres:{WRONG_PASSWORD}@127.0.0.1:{}/postgres?sslmode=disable",
        pg.port()
    ));
    let error = ReplicationConnection::connect(&info).await.unwrap_err();
    assert_eq!(error.sqlstate(), Some("28P01"), "{error}");
    assert!(!error.is_transient());
    assert!(
        error
            .to_string()
            .contains("check the password in DATABASE_URL"),
        "{error}"
    );
    assert_no_password(&error);
}

#[tokio::test]
async fn md5_right_and_wrong_password_and_tls_required() {
    let pg = md5();
    let mut connection = ReplicationConnection::connect(&tcp(pg, "postgres", ""))
        .await
        .expect("connect with md5 (sslmode=prefer falls back to plaintext)");
    assert!(!connection.is_tls());
    assert_eq!(connection.sasl_mechanism(), None);
    connection.identify_system().await.expect("IDENTIFY_SYSTEM");

    let info = conninfo(&format!(
        "host=127.0.0.1 port={} user=postgres password={} sslmode=disable",
        pg.port(),
        quote(WRONG_PASSWORD)
    ));
    let error = ReplicationConnection::connect(&info).await.unwrap_err();
    assert_eq!(error.sqlstate(), Some("28P01"), "{error}");
    assert!(!error.is_transient());
    assert_no_password(&error);

    let info = conninfo(&format!(
        "host=127.0.0.1 port={} user=postgres sslmode=disable",
        pg.port()
    ));
    let error = ReplicationConnection::connect(&info).await.unwrap_err();
    assert!(matches!(error, Error::Auth(_)), "{error}");
    assert!(error.to_string().contains("none was given"), "{error}");

    let error = ReplicationConnection::connect(&tcp(pg, "postgres", "sslmode=require"))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::TlsUnsupported { .. }), "{error}");
    assert!(error.to_string().contains("sslmode=require"), "{error}");
    assert!(!error.is_transient());
}

#[tokio::test]
async fn tls_verify_full_with_channel_binding() {
    let pg = scram_tls();
    let info = conninfo(&format!(
        "postgres://postgres:{}@localhost:{}/postgres?sslmode=verify-full&sslrootcert={}",
        "Sup3r-s3cret%27pw",
        pg.port(),
        pg.ca_cert_path().expect("tls").display()
    ));
    let mut connection = ReplicationConnection::connect(&info)
        .await
        .expect("connect");
    assert!(connection.is_tls());
    assert_eq!(
        connection.sasl_mechanism(),
        Some("SCRAM-SHA-256-PLUS"),
        "channel binding is used on TLS"
    );
    let rows = connection
        .simple_query("SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .await
        .expect("query");
    assert_eq!(rows, vec![vec![Some("true".to_owned())]]);
    connection.identify_system().await.expect("IDENTIFY_SYSTEM");
}

#[tokio::test]
async fn tls_verify_ca_skips_the_host_name_but_not_the_chain() {
    let pg = scram_tls();
    // An IPv4-mapped IPv6 address reaches the server but is not a name in its certificate.
    let other_name = |extra: &str| {
        conninfo(&format!(
            "host=::ffff:127.0.0.1 port={} user=postgres password={} dbname=postgres {extra}",
            pg.port(),
            quote(PASSWORD)
        ))
    };

    let connection = ReplicationConnection::connect(&other_name(&format!(
        "sslmode=verify-ca sslrootcert={}",
        ca(pg)
    )))
    .await
    .expect("verify-ca accepts a certificate for another name");
    assert!(connection.is_tls());

    let error = ReplicationConnection::connect(&other_name(&format!(
        "sslmode=verify-full sslrootcert={}",
        ca(pg)
    )))
    .await
    .unwrap_err();
    assert!(matches!(error, Error::TlsHandshake { .. }), "{error}");
    assert!(error.to_string().contains("verify-ca"), "hint: {error}");
    assert!(!error.is_transient());

    let error = refused_by_an_unrelated_ca(pg, "verify-ca").await;
    assert!(matches!(error, Error::TlsHandshake { .. }), "{error}");
    assert!(!error.is_transient());
    assert_no_password(&error);
}

#[tokio::test]
async fn tls_require_encrypts_and_checks_the_chain_only_with_a_root_certificate() {
    let pg = scram_tls();
    let connection = ReplicationConnection::connect(&conninfo(&format!(
        "host=::ffff:127.0.0.1 port={} user=postgres password={} sslmode=require",
        pg.port(),
        quote(PASSWORD)
    )))
    .await
    .expect("require without a root certificate verifies nothing");
    assert!(connection.is_tls());
    assert_eq!(connection.sasl_mechanism(), Some("SCRAM-SHA-256-PLUS"));

    let error = refused_by_an_unrelated_ca(pg, "require").await;
    assert!(
        matches!(error, Error::TlsHandshake { .. }),
        "require with sslrootcert is verify-ca: {error}"
    );
}

#[tokio::test]
async fn tls_verify_full_rejects_a_wrong_ca() {
    let pg = scram_tls();
    let info = conninfo(&format!(
        "host=localhost port={} user=postgres password={} sslmode=verify-full sslrootcert={}",
        pg.port(),
        quote(PASSWORD),
        unrelated_ca()
    ));
    let error = ReplicationConnection::connect(&info).await.unwrap_err();
    assert!(
        matches!(
            &error,
            Error::TlsHandshake {
                source: rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
                ..
            }
        ),
        "{error:?}"
    );
    assert!(!error.is_transient());
    assert!(error.to_string().contains("sslrootcert"), "{error}");

    let error = connect_sql(&info).await.unwrap_err();
    assert!(!error.is_transient(), "{error:?}");
}

#[tokio::test]
async fn connect_sql_pins_the_session_and_uses_tls() {
    let pg = scram_tls();
    let info = conninfo(&format!(
        "host=localhost port={} user=postgres password={} sslmode=verify-full sslrootcert={} \
         application_name=relay-test",
        pg.port(),
        quote(PASSWORD),
        ca(pg)
    ));
    let client = connect_sql(&info).await.expect("connect_sql");
    let row = client
        .query_one(
            "SELECT current_setting('TimeZone'), current_setting('DateStyle'), \
             current_setting('application_name'), ssl FROM pg_stat_ssl \
             WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("query");
    assert_eq!(row.get::<_, String>(0), "UTC");
    assert!(row.get::<_, String>(1).starts_with("ISO"));
    assert_eq!(row.get::<_, String>(2), "relay-test");
    assert!(row.get::<_, bool>(3));

    let wrong = conninfo(&format!(
        "host=localhost port={} user=postgres password={} sslmode=verify-full sslrootcert={}",
        pg.port(),
        quote(WRONG_PASSWORD),
        ca(pg)
    ));
    let error = connect_sql(&wrong).await.unwrap_err();
    assert_eq!(error.sqlstate(), Some("28P01"), "{error}");
    assert!(!error.is_transient());
    assert_no_password(&error);
}

#[tokio::test]
async fn missing_slot_is_permanent_with_a_hint() {
    let pg = scram_tls();
    outbox_database(pg, "missing_slot", &[]);
    let connection = ReplicationConnection::connect(&tcp(pg, "missing_slot", ""))
        .await
        .expect("connect");
    let error = connection
        .start_logical_replication("no \"such\" slot", Lsn::ZERO, &[("proto_version", "1")])
        .await
        .unwrap_err();
    assert_eq!(error.sqlstate(), Some("42704"), "{error}");
    assert!(!error.is_transient());
    assert!(error.to_string().contains("no \"such\" slot"), "{error}");
    assert!(
        error.to_string().contains("create the slot first"),
        "{error}"
    );
}

#[tokio::test]
async fn stream_transactions_and_confirm_the_flush_position() {
    let pg = scram_tls();
    outbox_database(pg, "stream_confirm", &["relay_slot"]);
    let info = conninfo(&format!(
        "host=localhost port={} user=postgres password={} dbname=stream_confirm \
         sslmode=verify-full sslrootcert={}",
        pg.port(),
        quote(PASSWORD),
        ca(pg)
    ));

    let mut control = ReplicationConnection::connect(&info)
        .await
        .expect("connect");
    assert_eq!(
        control.wal_sender_timeout().await.expect("SHOW"),
        Some(Duration::from_secs(10))
    );
    let created_at = control
        .confirmed_flush_lsn("relay_slot")
        .await
        .expect("query")
        .expect("the slot exists");
    assert_eq!(
        control.confirmed_flush_lsn("nope").await.expect("query"),
        None
    );

    let mut stream = start(&info, "relay_slot").await;
    pg.psql(
        "stream_confirm",
        "INSERT INTO outbox (payload) VALUES ('a'), ('b'), ('c')",
    );
    let (tags, end_lsn) = recv_transaction(&mut stream).await;
    assert_eq!(tags, b"BRIIIC", "Begin, Relation, three Inserts, Commit");
    assert!(end_lsn > created_at);

    stream
        .send_status(StandbyStatusUpdate {
            write_lsn: end_lsn,
            flush_lsn: end_lsn,
            apply_lsn: end_lsn,
            send_time: pg_timestamp(std::time::SystemTime::now()),
            reply_requested: false,
        })
        .await
        .expect("send status");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let confirmed = control
            .confirmed_flush_lsn("relay_slot")
            .await
            .expect("query");
        if confirmed == Some(end_lsn) {
            break;
        }
        assert!(
            confirmed <= Some(end_lsn),
            "confirmed {confirmed:?} beyond what we sent ({end_lsn})"
        );
        assert!(
            Instant::now() < deadline,
            "confirmed_flush_lsn stayed at {confirmed:?}, expected {end_lsn}"
        );
        sleep(Duration::from_millis(20)).await;
    }

    // A second transaction arrives on the same stream, then the stream ends cleanly.
    pg.psql(
        "stream_confirm",
        "INSERT INTO outbox (payload) VALUES ('d')",
    );
    let (tags, second_end) = recv_transaction(&mut stream).await;
    assert_eq!(tags, b"BIC");
    assert!(second_end > end_lsn);
    stream.finish().await.expect("finish");
    control.close().await.expect("close");
}

#[tokio::test]
async fn keepalives_keep_an_idle_stream_alive_past_wal_sender_timeout() {
    let pg = scram_tls();
    outbox_database(pg, "keepalive", &["answered", "silent"]);
    pg.psql(
        "keepalive",
        "CREATE ROLE quick LOGIN REPLICATION PASSWORD 'quick-pw';\n\
         ALTER ROLE quick SET wal_sender_timeout = '1s';",
    );
    let info = conninfo(&format!(
        "host=127.0.0.1 port={} user=quick password=quick-pw dbname=keepalive",
        pg.port()
    ));
    let mut connection = ReplicationConnection::connect(&info)
        .await
        .expect("connect");
    let wal_sender_timeout = connection
        .wal_sender_timeout()
        .await
        .expect("SHOW")
        .expect("enabled");
    assert_eq!(wal_sender_timeout, Duration::from_secs(1));
    let mut feedback = Feedback::new(status_interval(Some(wal_sender_timeout)));
    let names = publication_names(&["pub"]);
    let options = [
        ("proto_version", "1"),
        ("publication_names", names.as_str()),
    ];
    let mut answered = connection
        .start_logical_replication("answered", Lsn::ZERO, &options)
        .await
        .expect("start");
    // Heartbeats ask for a reply, so a healthy idle server is heard from in time.
    answered.set_idle_timeout(Some(wal_sender_timeout));
    // The control experiment: a stream that never reports is dropped by the server.
    let mut silent = start(&info, "silent").await;

    let deadline = Instant::now() + 3 * wal_sender_timeout + Duration::from_millis(500);
    let mut silent_error = None;
    loop {
        let due = feedback.next_due().unwrap_or_else(Instant::now);
        tokio::select! {
            biased;
            _ = sleep_until(deadline) => break,
            _ = sleep_until(due) => answered.send_feedback(&mut feedback).await.expect("status"),
            // The server pings at last_reply + timeout / 2, right when our next status is
            // due, so it often asks first; the reply goes out at once.
            message = answered.recv() => {
                let message = message.expect("the answered stream stays up");
                if reply_requested(&message) {
                    answered.send_feedback(&mut feedback).await.expect("status");
                }
            }
            result = silent.recv(), if silent_error.is_none() => {
                if let Err(error) = result {
                    silent_error = Some(error);
                }
            }
        }
    }
    let silent_error = silent_error.expect("the silent stream was dropped by the server");
    assert!(silent_error.is_transient(), "{silent_error}");

    // Still streaming.
    pg.psql("keepalive", "INSERT INTO outbox (payload) VALUES ('late')");
    let (tags, _) = recv_transaction(&mut answered).await;
    assert_eq!(tags, b"BRIC");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trust_over_unix_socket_and_a_crash_is_transient() {
    let mut pg = Postgres::start();
    outbox_database(&pg, "crash", &["crash_slot"]);
    let socket_dir: &Path = pg.data_dir().parent().expect("socket dir");
    let info = conninfo(&format!(
        "host={} port={} user=postgres dbname=crash sslmode=require",
        quote(&socket_dir.display().to_string()),
        pg.port()
    ));
    assert!(info.is_unix_socket());
    let mut connection = ReplicationConnection::connect(&info)
        .await
        .expect("trust over the unix socket (no TLS there, whatever sslmode says)");
    assert!(!connection.is_tls());
    let system = connection.identify_system().await.expect("IDENTIFY_SYSTEM");
    assert_eq!(system.dbname.as_deref(), Some("crash"));
    connection.close().await.expect("close");

    let info = conninfo(&format!(
        "host=127.0.0.1 port={} user=postgres dbname=crash",
        pg.port()
    ));
    let mut stream = start(&info, "crash_slot").await;
    tokio::task::block_in_place(|| pg.crash());
    let error = timeout(Duration::from_secs(10), async {
        loop {
            if let Err(error) = stream.recv().await {
                return error;
            }
        }
    })
    .await
    .expect("recv fails within 10 s of the crash");
    assert!(error.is_transient(), "{error:?}");

    let error = ReplicationConnection::connect(&info).await.unwrap_err();
    assert!(
        error.is_transient(),
        "connection refused is transient: {error}"
    );
}

// ---------------------------------------------------------------------------------------
// libpq compatibility: PG* environment, password file, client certificates,
// channel_binding, require_auth, connect_timeout. Each on both connections: the
// replication connection and the control connection (connect_sql).
// ---------------------------------------------------------------------------------------

/// Connects both ways; returns the replication connection's SASL mechanism.
async fn connect_both(info: &ConnInfo) -> Option<&'static str> {
    let mut connection = ReplicationConnection::connect(info)
        .await
        .expect("replication connection");
    connection.identify_system().await.expect("IDENTIFY_SYSTEM");
    let mechanism = connection.sasl_mechanism();
    let client = connect_sql(info).await.expect("control connection");
    client.simple_query("SELECT 1").await.expect("query");
    mechanism
}

/// Both connections fail; returns both errors.
async fn fail_both(info: &ConnInfo) -> [Error; 2] {
    let replication = ReplicationConnection::connect(info)
        .await
        .expect_err("the replication connection must fail");
    let control = connect_sql(info)
        .await
        .expect_err("the control connection must fail");
    [replication, control]
}

#[tokio::test]
async fn pg_environment_variables_and_a_password_file_supply_the_password() {
    let pg = scram_tls();
    let dir = testkit::scratch_dir("pgpass");
    let passfile = dir.path().join("pgpass");
    // libpq's format: the escaped ':' and '\' of the password, a comment, a non-matching line.
    let escaped = PASSWORD.replace('\\', "\\\\").replace(':', "\\:");
    testkit::write_file_mode(
        &passfile,
        &format!(
            "# relay\n127.0.0.1:1:*:*:wrong\n127.0.0.1:{}:*:postgres:{escaped}\n",
            pg.port()
        ),
        0o600,
    );
    let port = pg.port().to_string();
    let passfile_text = passfile.display().to_string();
    let vars: Vec<(&str, &str)> = vec![
        ("PGHOST", "127.0.0.1"),
        ("PGPORT", &port),
        ("PGUSER", "postgres"),
        ("PGDATABASE", "postgres"),
        ("PGSSLMODE", "require"),
        ("PGPASSFILE", &passfile_text),
    ];
    let env = |vars: Vec<(&str, &str)>| {
        let vars: std::collections::BTreeMap<String, String> = vars
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        move |name: &str| vars.get(name).cloned()
    };

    // Everything from PG* variables, the password from the file.
    let info = ConnInfo::parse_with_env("", env(vars.clone())).expect("conninfo");
    assert_eq!(
        info.source("password"),
        &replication::Source::PassFile(passfile.clone())
    );
    assert_eq!(connect_both(&info).await, Some("SCRAM-SHA-256-PLUS"));

    // PGPASSWORD wins over the file (here: a wrong one, so the server says so).
    let mut with_wrong = vars.clone();
    with_wrong.push(("PGPASSWORD", WRONG_PASSWORD));
    let info = ConnInfo::parse_with_env("", env(with_wrong)).expect("conninfo");
    for error in fail_both(&info).await {
        assert_eq!(error.sqlstate(), Some("28P01"), "{error}");
        assert_no_password(&error);
    }

    // A connection string overrides the variables it names, and only those.
    let info = ConnInfo::parse_with_env("dbname=template1", env(vars.clone())).expect("conninfo");
    assert_eq!(info.dbname(), "template1");
    connect_both(&info).await;

    // A password file that others can read is ignored, with a warning; then there is no
    // password, and the error says where to put one.
    testkit::write_file_mode(
        &passfile,
        &std::fs::read_to_string(&passfile).unwrap(),
        0o644,
    );
    let info = ConnInfo::parse_with_env("", env(vars)).expect("conninfo");
    assert!(
        info.warnings()
            .iter()
            .any(|w| w.contains("group or world access")),
        "{:?}",
        info.warnings()
    );
    for error in fail_both(&info).await {
        assert!(error.to_string().contains("none was given"), "{error}");
        assert!(error.to_string().contains("pgpass"), "{error}");
        assert!(!error.is_transient());
    }
}

/// A TLS server with a pg_hba.conf of per-user methods: `certuser` by client certificate
/// (hostssl ... cert), `md5user` by md5, `plainuser` by cleartext password, everyone else by
/// SCRAM. Returns the server and the client certificate and key files for `certuser`.
struct HbaServer {
    pg: Postgres,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn hba_server() -> &'static HbaServer {
    static SERVER: OnceLock<HbaServer> = OnceLock::new();
    testkit::shared(&SERVER, || {
        // Kept for the life of the test process, as the server is.
        let dir = testkit::scratch_dir("hba").keep();
        // A CA for client certificates, and certuser's certificate (CN = the role name).
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA");
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "relay test client CA");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca_cert = ca_params.self_signed(&ca_key).expect("self-sign CA");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let client_key = rcgen::KeyPair::generate().expect("client key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("client");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "certuser");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let client_cert = params
            .signed_by(&client_key, &issuer)
            .expect("sign client certificate");
        let ca_path = dir.join("client-ca.crt");
        testkit::write_file_mode(&ca_path, &ca_cert.pem(), 0o644);
        let client_cert_path = dir.join("client.crt");
        testkit::write_file_mode(&client_cert_path, &client_cert.pem(), 0o644);
        let client_key_path = dir.join("client.key");
        testkit::write_file_mode(&client_key_path, &client_key.serialize_pem(), 0o600);

        let mut hba = String::from("local all all trust\nlocal replication all trust\n");
        for (kind, user, method) in [
            ("hostssl", "certuser", "cert"),
            ("host", "md5user", "md5"),
            ("host", "plainuser", "password"),
            ("host", "all", "scram-sha-256"),
        ] {
            for database in ["all", "replication"] {
                hba.push_str(&format!("{kind} {database} {user} 127.0.0.1/32 {method}\n"));
            }
        }
        let hba_path = dir.join("pg_hba.conf");
        testkit::write_file_mode(&hba_path, &hba, 0o644);
        let pg = Postgres::start_with(PgOptions {
            auth: PgAuth::Scram,
            password: Some(PASSWORD.to_owned()),
            tls: true,
            settings: vec![
                ("hba_file".into(), hba_path.display().to_string()),
                ("ssl_ca_file".into(), ca_path.display().to_string()),
            ],
            bin_dir: None,
        });
        pg.psql(
            "postgres",
            &format!(
                "CREATE ROLE certuser LOGIN REPLICATION;
                 SET password_encryption = 'md5';
                 CREATE ROLE md5user LOGIN REPLICATION PASSWORD {0};
                 CREATE ROLE plainuser LOGIN REPLICATION PASSWORD {0};",
                quote(PASSWORD).replace("\\'", "''")
            ),
        );
        HbaServer {
            pg,
            client_cert: client_cert_path,
            client_key: client_key_path,
        }
    })
}

fn as_user(server: &HbaServer, user: &str, password: &str, extra: &str) -> ConnInfo {
    conninfo(&format!(
        "host=localhost port={} user={user} password={} dbname=postgres sslrootcert={} \
         connect_timeout=10 {extra}",
        server.pg.port(),
        quote(password),
        ca(&server.pg)
    ))
}

#[tokio::test]
async fn client_certificate_authentication_with_hostssl_cert() {
    let server = hba_server();
    let files = format!(
        "sslmode=verify-full sslcert={} sslkey={}",
        quote(&server.client_cert.display().to_string()),
        quote(&server.client_key.display().to_string())
    );
    let info = conninfo(&format!(
        "host=localhost port={} user=certuser dbname=postgres sslrootcert={} {files}",
        server.pg.port(),
        ca(&server.pg)
    ));
    assert_eq!(
        connect_both(&info).await,
        None,
        "no password: the certificate"
    );

    // Without the certificate the server refuses (and says which pg_hba line).
    let info = conninfo(&format!(
        "host=localhost port={} user=certuser dbname=postgres sslmode=verify-full sslrootcert={}",
        server.pg.port(),
        ca(&server.pg)
    ));
    for error in fail_both(&info).await {
        assert_eq!(error.sqlstate(), Some("28000"), "{error}");
        assert!(!error.is_transient());
    }
}

#[tokio::test]
async fn channel_binding_require_uses_scram_plus_and_refuses_md5_and_cleartext() {
    // SCRAM-SHA-256-PLUS on both connections.
    let pg = scram_tls();
    let info = tcp(pg, "postgres", "sslmode=require channel_binding=require");
    assert_eq!(connect_both(&info).await, Some("SCRAM-SHA-256-PLUS"));

    // md5 and cleartext are refused before the password is sent: with a wrong password,
    // the error is ours, not the server's "password authentication failed".
    let server = hba_server();
    for (user, what) in [
        ("md5user", "an md5 password hash"),
        ("plainuser", "a cleartext password"),
    ] {
        let info = as_user(
            server,
            user,
            WRONG_PASSWORD,
            "sslmode=verify-full channel_binding=require",
        );
        for error in fail_both(&info).await {
            assert!(matches!(error, Error::Auth(_)), "{user}: {error:?}");
            assert!(
                error.to_string().contains(what) && error.to_string().contains("nothing was sent"),
                "{user}: {error}"
            );
            assert_eq!(
                error.sqlstate(),
                None,
                "the server never saw a password: {error}"
            );
            assert!(!error.is_transient());
            assert_no_password(&error);
        }
        // Without channel_binding=require the same user connects (so it was the policy).
        let info = as_user(server, user, PASSWORD, "sslmode=verify-full");
        connect_both(&info).await;
    }

    // channel_binding=disable: plain SCRAM even where PLUS is offered.
    let info = tcp(pg, "postgres", "sslmode=require channel_binding=disable");
    assert_eq!(connect_both(&info).await, Some("SCRAM-SHA-256"));

    // A server without TLS cannot bind: refused under sslmode=prefer too.
    let md5 = md5();
    let info = tcp(md5, "postgres", "channel_binding=require");
    for error in fail_both(&info).await {
        assert!(error.to_string().contains("does not use TLS"), "{error}");
        assert!(!error.is_transient());
    }
}

#[tokio::test]
async fn require_auth_refuses_other_methods_on_both_connections() {
    let server = hba_server();
    let info = as_user(
        server,
        "md5user",
        WRONG_PASSWORD,
        "sslmode=verify-full require_auth=scram-sha-256",
    );
    for error in fail_both(&info).await {
        assert!(
            error.to_string().contains("md5 password authentication")
                && error.to_string().contains("require_auth=scram-sha-256"),
            "{error}"
        );
        assert_eq!(error.sqlstate(), None, "nothing was sent: {error}");
    }
    let info = as_user(
        server,
        "postgres",
        PASSWORD,
        "sslmode=verify-full require_auth=!password,!md5",
    );
    connect_both(&info).await;
}

#[tokio::test]
async fn connect_timeout_bounds_a_server_that_never_answers() {
    // Accepts connections and never says a word.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let _accepting = std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming() {
            held.push(stream);
        }
    });
    let info = conninfo(&format!(
        "host=127.0.0.1 port={port} user=postgres password=pw connect_timeout=2"
    ));
    for (which, result) in [
        (
            "replication",
            timeout(
                Duration::from_secs(10),
                ReplicationConnection::connect(&info),
            )
            .await
            .map(|r| r.err()),
        ),
        (
            "control",
            timeout(Duration::from_secs(10), connect_sql(&info))
                .await
                .map(|r| r.err()),
        ),
    ] {
        let error = result
            .unwrap_or_else(|_| panic!("{which}: connect_timeout=2 did not bound the connect"))
            .unwrap_or_else(|| panic!("{which}: connected to a silent server"));
        assert!(matches!(error, Error::Timeout { .. }), "{which}: {error}");
        assert!(error.to_string().contains("connect_timeout"), "{error}");
        assert!(error.is_transient());
    }
    // Without connect_timeout, the default bounds it.
    let info = conninfo(&format!("host=127.0.0.1 port={port} user=postgres"));
    assert_eq!(
        info.connect_timeout(),
        Some(replication::DEFAULT_CONNECT_TIMEOUT)
    );
}
