//! Proves the harness itself: real servers start, die and come back.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use testkit::{free_port, wait_until, Nats, PgAuth, PgOptions, Postgres, Process, Proxy};

/// Run psql with an explicit conninfo and password (not via the harness).
fn psql_as(
    pg: &Postgres,
    conninfo: &str,
    password: Option<&str>,
    sql: &str,
) -> Result<String, String> {
    let mut command = Command::new(pg.bin_dir().join("psql"));
    command
        .args([
            "-X",
            "-q",
            "-At",
            "-w",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            sql,
            "-d",
            conninfo,
        ])
        .env("PGPASSFILE", "/nonexistent/testkit-no-pgpass")
        .env_remove("PGPASSWORD");
    if let Some(password) = password {
        command.env("PGPASSWORD", password);
    }
    let output = command.output().expect("run psql");
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

#[test]
fn handles_can_live_in_statics() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<Postgres>();
    send_sync::<Nats>();
    send_sync::<Process>();
    send_sync::<Proxy>();
    send_sync::<PgOptions>();
}

#[test]
fn free_ports_are_distinct_and_bindable() {
    let a = free_port();
    let b = free_port();
    assert_ne!(a, b);
    TcpListener::bind(("127.0.0.1", a)).expect("free port is bindable");
}

#[test]
fn postgres_starts_with_logical_wal_and_survives_crash() {
    let started = Instant::now();
    let mut pg = Postgres::start();
    eprintln!("postgres start: {:?}", started.elapsed());
    assert_eq!(pg.host(), "127.0.0.1");
    assert_ne!(pg.port(), 5432);
    assert_eq!(
        pg.url("app"),
        format!("postgres://postgres@127.0.0.1:{}/app", pg.port())
    );
    assert_eq!(pg.psql("postgres", "show wal_level"), "logical");
    assert_eq!(pg.psql("postgres", "show synchronous_commit"), "on");
    assert_eq!(pg.psql("postgres", "show max_replication_slots"), "20");
    assert!(pg.is_running());

    // The pid we hold is the postmaster itself.
    let postmaster = pg.psql("postgres", "select pg_postmaster_start_time() is not null");
    assert_eq!(postmaster, "t");
    let pid_file =
        std::fs::read_to_string(pg.data_dir().join("postmaster.pid")).expect("postmaster.pid");
    assert_eq!(pid_file.lines().next(), Some(pg.pid().to_string().as_str()));

    pg.create_database("app db");
    pg.psql(
        "app db",
        "create table t (id int primary key, v text); insert into t values (1, 'one'), (2, 'two');",
    );
    let old_pid = pg.pid();

    pg.crash();
    assert!(!pg.is_running());
    assert!(pg.try_psql("app db", "select 1").is_err());

    let restarted = Instant::now();
    pg.start_again();
    eprintln!(
        "postgres start_again after crash: {:?}",
        restarted.elapsed()
    );
    assert_ne!(pg.pid(), old_pid);
    assert_eq!(
        pg.psql("app db", "select string_agg(v, ',' order by id) from t"),
        "one,two"
    );
    assert!(
        pg.log().contains("database system was interrupted")
            || pg.log().contains("not properly shut down")
    );

    pg.stop();
    assert!(!pg.is_running());
    pg.restart(); // crash of a stopped server is a no-op, then start again
    assert_eq!(pg.psql("app db", "select count(*) from t"), "2");

    let err = pg
        .try_psql("postgres", "select * from no_such_table")
        .unwrap_err();
    assert!(err.contains("no_such_table"), "{err}");
}

fn check_password_auth(auth: PgAuth, expected_stored_prefix: &str) {
    let pg = Postgres::start_with(PgOptions {
        auth,
        password: Some("s3cret p@ss".to_string()),
        ..PgOptions::default()
    });
    assert_eq!(pg.password(), Some("s3cret p@ss"));
    assert_eq!(
        pg.url("postgres"),
        format!(
            "postgres://postgres:s3cret%20p%40ss@127.0.0.1:{}/postgres",
            pg.port()
        )
    );
    // The harness itself authenticates.
    assert_eq!(pg.psql("postgres", "select current_user"), "postgres");
    let conninfo = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        pg.port()
    );
    let err =
        psql_as(&pg, &conninfo, Some("wrong"), "select 1").expect_err("wrong password accepted");
    assert!(err.contains("password authentication failed"), "{err}");
    let err = psql_as(&pg, &conninfo, None, "select 1").expect_err("missing password accepted");
    assert!(err.contains("no password supplied"), "{err}");
    assert_eq!(
        psql_as(&pg, &conninfo, Some("s3cret p@ss"), "select 1").expect("right password"),
        "1"
    );
    let stored = pg.psql(
        "postgres",
        "select rolpassword from pg_authid where rolname = 'postgres'",
    );
    assert!(stored.starts_with(expected_stored_prefix), "{stored}");
    // Replication connections use the same method.
    let repl = format!("{conninfo} replication=database");
    assert!(psql_as(&pg, &repl, Some("wrong"), "IDENTIFY_SYSTEM").is_err());
    let ident = psql_as(&pg, &repl, Some("s3cret p@ss"), "IDENTIFY_SYSTEM")
        .expect("replication connection");
    assert!(ident.contains("postgres"), "{ident}");
}

#[test]
fn postgres_md5_auth() {
    check_password_auth(PgAuth::Md5, "md5");
}

#[test]
fn postgres_scram_auth() {
    check_password_auth(PgAuth::Scram, "SCRAM-SHA-256$");
}

#[test]
fn postgres_tls_verify_full() {
    let pg = Postgres::start_with(PgOptions {
        tls: true,
        settings: vec![("work_mem".to_string(), "8MB".to_string())],
        ..PgOptions::default()
    });
    let ca = pg.ca_cert_path().expect("tls CA");
    assert!(std::fs::read_to_string(ca)
        .expect("read CA")
        .contains("BEGIN CERTIFICATE"));
    assert_eq!(pg.psql("postgres", "show work_mem"), "8MB");
    for host in ["localhost", "127.0.0.1"] {
        let conninfo = format!(
            "sslmode=verify-full sslrootcert={} host={host} port={} user=postgres dbname=postgres",
            ca.display(),
            pg.port()
        );
        let ssl = psql_as(
            &pg,
            &conninfo,
            None,
            "select ssl from pg_stat_ssl where pid = pg_backend_pid()",
        )
        .expect("verify-full connection");
        assert_eq!(ssl, "t");
    }
    // Plain connections still work.
    let plain = format!(
        "sslmode=disable host=127.0.0.1 port={} user=postgres dbname=postgres",
        pg.port()
    );
    assert_eq!(
        psql_as(&pg, &plain, None, "select 1").expect("plain connection"),
        "1"
    );
    // verify-full against a CA that did not sign the server cert fails.
    let other = Postgres::start_with(PgOptions {
        tls: true,
        ..PgOptions::default()
    });
    let wrong = format!(
        "sslmode=verify-full sslrootcert={} host=localhost port={} user=postgres dbname=postgres",
        other.ca_cert_path().expect("other CA").display(),
        pg.port()
    );
    let err = psql_as(&pg, &wrong, None, "select 1").expect_err("foreign CA accepted");
    assert!(err.contains("certificate verify failed"), "{err}");
}

/// Read the INFO line a NATS server sends on connect.
fn nats_info(port: u16) -> String {
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to nats");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .expect("read INFO");
    line
}

#[test]
fn nats_kill_and_start_again_keeps_port_with_jetstream() {
    let started = Instant::now();
    let mut nats = Nats::start();
    eprintln!("nats start: {:?}", started.elapsed());
    let port = nats.port();
    assert_ne!(port, 4222);
    assert_eq!(nats.url(), format!("nats://127.0.0.1:{port}"));
    assert!(nats_info(port).contains("\"jetstream\":true"));
    let (code, body) = nats.monitor_get("/jsz").expect("jsz");
    assert_eq!(code, 200);
    assert!(
        body.contains(&nats.store_dir().display().to_string()),
        "{body}"
    );

    let old_pid = nats.pid();
    nats.kill();
    assert!(!nats.is_running());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());

    let restarted = Instant::now();
    nats.start_again();
    eprintln!("nats start_again after kill: {:?}", restarted.elapsed());
    assert_ne!(nats.pid(), old_pid);
    assert_eq!(nats.port(), port);
    assert!(nats_info(port).contains("\"jetstream\":true"));
    let (code, _) = nats
        .monitor_get("/healthz?js-enabled-only=true")
        .expect("healthz");
    assert_eq!(code, 200);

    nats.stop();
    assert!(!nats.is_running());
    assert!(
        nats.log().contains("Server Exiting") || nats.log().contains("Exiting"),
        "{}",
        nats.log()
    );
    nats.start_again();
    assert!(nats.is_running());
}

#[test]
fn nats_extra_args() {
    let nats = Nats::start_with_args(&["--server_name", "testkit-extra"]);
    let info = nats_info(nats.port());
    assert!(info.contains("\"server_name\":\"testkit-extra\""), "{info}");
}

#[test]
fn process_captures_output_and_reports_exit_status() {
    let mut command = Command::new("sh");
    command.args([
        "-c",
        "echo hello from stdout; echo oops from stderr >&2; \
         trap 'echo got TERM; exit 3' TERM; \
         echo ready; while true; do sleep 0.02; done",
    ]);
    let mut process = Process::spawn("sh", command);
    process.wait_for_output("ready", Duration::from_secs(5));
    // stdout and stderr are separate pipes: no ordering between them.
    process.wait_for_output("oops from stderr", Duration::from_secs(5));
    let output = process.output();
    assert!(output.contains("hello from stdout\n"), "{output}");
    assert!(output.contains("oops from stderr\n"), "{output}");
    assert!(process.try_status().is_none());
    let status = process.terminate(Duration::from_secs(5));
    assert_eq!(status.code(), Some(3));
    assert!(
        process.output().contains("got TERM"),
        "{}",
        process.output()
    );
    assert_eq!(process.try_status().map(|s| s.code()), Some(Some(3)));

    let mut quick = Process::spawn("true", Command::new("true"));
    assert!(quick.wait_exit(Duration::from_secs(5)).success());

    let mut sleeper = Process::spawn("sleep", {
        let mut c = Command::new("sleep");
        c.arg("30");
        c
    });
    sleeper.kill();
    assert!(sleeper.try_status().is_some());
}

#[test]
#[should_panic(expected = "without printing")]
fn process_wait_for_output_fails_fast_when_the_process_exits() {
    let process = Process::spawn("echo", {
        let mut c = Command::new("echo");
        c.arg("something else");
        c
    });
    process.wait_for_output("never printed", Duration::from_secs(30));
}

#[test]
#[should_panic(expected = "timed out after")]
fn wait_until_times_out() {
    wait_until("the impossible", Duration::from_millis(50), || false);
}

/// Echo server: writes back whatever it reads. Returns its address.
fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind echo");
    let addr = listener.local_addr().expect("addr");
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

fn read_exact_timeout(
    stream: &mut TcpStream,
    len: usize,
    timeout: Duration,
) -> std::io::Result<Vec<u8>> {
    stream.set_read_timeout(Some(timeout))?;
    let mut buf = vec![0u8; len];
    stream.read_exact(&mut buf)?;
    Ok(buf)
}

#[test]
fn proxy_forwards_cuts_and_blackholes() {
    let proxy = Proxy::start(echo_server());
    assert_eq!(proxy.addr().port(), proxy.port());
    let mut client = TcpStream::connect(proxy.addr()).expect("connect proxy");
    client.write_all(b"ping").expect("write");
    assert_eq!(
        read_exact_timeout(&mut client, 4, Duration::from_secs(5)).expect("echo"),
        b"ping"
    );
    assert_eq!(proxy.connection_count(), 1);

    // Blackhole: the request reaches upstream, the reply is held back...
    proxy.set_blackhole(true);
    client.write_all(b"held").expect("write");
    let err = read_exact_timeout(&mut client, 4, Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err}"
    );
    // ...and released, not dropped, when switched off.
    proxy.set_blackhole(false);
    assert_eq!(
        read_exact_timeout(&mut client, 4, Duration::from_secs(5)).expect("released"),
        b"held"
    );

    // Cut: the client sees its connection end.
    let mut second = TcpStream::connect(proxy.addr()).expect("connect proxy");
    second.write_all(b"x").expect("write");
    assert_eq!(
        read_exact_timeout(&mut second, 1, Duration::from_secs(5)).expect("echo"),
        b"x"
    );
    assert_eq!(proxy.connection_count(), 2);
    proxy.cut();
    assert_eq!(proxy.connection_count(), 0);
    for stream in [&mut client, &mut second] {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 1];
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => {}
            Ok(n) => panic!("read {n} bytes from a cut connection"),
        }
    }

    // New connections still work after a cut.
    let mut third = TcpStream::connect(proxy.addr()).expect("connect proxy");
    third.write_all(b"again").expect("write");
    assert_eq!(
        read_exact_timeout(&mut third, 5, Duration::from_secs(5)).expect("echo"),
        b"again"
    );
    drop(third);
    wait_until(
        "the closed connection to leave the proxy",
        Duration::from_secs(5),
        || proxy.connection_count() == 0,
    );
}

#[test]
fn proxy_in_front_of_postgres() {
    let pg = Postgres::start();
    let proxy = Proxy::start(SocketAddr::from(([127, 0, 0, 1], pg.port())));
    let conninfo = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.port()
    );
    assert_eq!(
        psql_as(&pg, &conninfo, None, "select 40 + 2").expect("through proxy"),
        "42"
    );
}
