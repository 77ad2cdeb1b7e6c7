//! The publishing connection (sink CN6, CN7, P11, P12) against real nats-servers configured
//! the way users run them: an account whose `max_payload` is below the server's (the INFO
//! after CONNECT says so), a user who may not publish one event type's subject, a
//! cluster node put into lame-duck mode during a load run, and a hostname whose first
//! address is black-holed. Each case: nothing lost, nothing twice, commit order kept, the
//! slot moving (dead-letter), or a halt naming the event (halt). Run on every nats-server
//! of the matrix (`TESTKIT_NATS_SERVER`, `.ci/run`).
//!
//! Each test starts its own nats-server with its configuration file; the Postgres is
//! shared by the tests of this binary.

#![allow(clippy::unwrap_used)]

use crate::support;

use support::sql_value;

use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use async_nats::jetstream;
use support::nats_jwt::{creds, operator_config};
use support::{
    assert_matches_row, check_faithful, eventually, rows_by_id, Case, Stored, Writers, DEADLINE,
};
use testkit::cluster::NatsCluster;
use testkit::{Nats, Postgres, Process};

/// The account's `max_payload`: far above an ordinary event, below the big row's 8 KB and
/// the server's own 1 MB.
const ACCOUNT_MAX_PAYLOAD: usize = 4096;

const USER: &str = "relay";
const PASSWORD: &str = "relay-s3cret";

fn pg() -> &'static Postgres {
    static PG: OnceLock<Postgres> = OnceLock::new();
    testkit::shared(&PG, Postgres::start)
}

/// A nats-server whose one account (JetStream enabled, `max_payload` limited) holds the
/// relay's user, with `permissions` (a config-file object, or empty).
fn nats_with_account(dir: &Path, permissions: &str) -> Nats {
    let config = format!(
        r#"
accounts {{
  A {{
    jetstream: enabled
    limits {{ max_payload: {ACCOUNT_MAX_PAYLOAD} }}
    users [ {{ user: {USER}, password: {PASSWORD} {permissions} }} ]
  }}
}}
"#
    );
    let path = dir.join("nats-server.conf");
    std::fs::write(&path, config).unwrap();
    Nats::start_with_args(&["-c", path.to_str().unwrap()])
}

/// How the relay and the test's client log in: the relay's environment and the client's
/// options.
struct Login {
    env: Vec<(String, String)>,
    client: async_nats::ConnectOptions,
}

impl Login {
    /// The config-file account's user.
    fn user() -> Login {
        Login {
            env: vec![
                ("OUTBOX_RELAY_NATS_USER".into(), USER.into()),
                ("OUTBOX_RELAY_NATS_PASSWORD".into(), PASSWORD.into()),
            ],
            client: async_nats::ConnectOptions::with_user_and_password(
                USER.into(),
                PASSWORD.into(),
            ),
        }
    }
}

/// Inserts one row per `(event_type, payload bytes)` in one transaction; returns the ids.
async fn insert(sql: &mut tokio_postgres::Client, rows: &[(&str, i32)], tag: &str) -> Vec<i64> {
    let tx = sql.transaction().await.unwrap();
    let mut ids = Vec::new();
    for (n, (event_type, bytes)) in rows.iter().enumerate() {
        let id: i64 = sql_value(
            &tx,
            "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) \
             values ('order-' || $1::text, $2::text, 'tmp-' || gen_random_uuid(), 'tmp', 'tmp', \
                     jsonb_build_object('tag', $3::text, 'blob', repeat('x', $4::int))) returning id",
            &[&(n as i32).to_string(), event_type, &tag, bytes],
        )
        .await;
        ids.push(id);
    }
    tx.commit().await.unwrap();
    ids
}

/// Three transactions, the odd row (`odd`: its event type and size) in the middle of the
/// second: returns every id in commit order and the odd one's.
async fn write_with_one_odd_row(
    sql: &mut tokio_postgres::Client,
    odd: (&str, i32),
) -> (Vec<i64>, i64) {
    let mut all = insert(sql, &[("OrderPaid", 10); 4], "before").await;
    let middle = insert(
        sql,
        &[("OrderPaid", 10), ("OrderPaid", 10), odd, ("OrderPaid", 10)],
        "middle",
    )
    .await;
    let odd_id = middle[2];
    all.extend(middle);
    all.extend(insert(sql, &[("OrderPaid", 10); 3], "after").await);
    (all, odd_id)
}

/// The stream holds `all` once each in commit order, the message at `odd`'s place a
/// dead-letter record naming it whose reason contains `because`; every other message is
/// its row; the slot confirmed past the last. Returns the messages.
async fn dead_lettered_in_place(
    case: &Case,
    js: &jetstream::Context,
    sql: &tokio_postgres::Client,
    (all, odd): (&[i64], i64),
    because: &str,
) -> Vec<Stored> {
    let (messages, last_commit) = case.wait_confirmed(js, sql, all.len() as u64).await;
    let ids: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    assert_eq!(
        ids, all,
        "every row once, in commit order, the record in the odd row's place"
    );
    let table = rows_by_id(sql).await;
    for message in &messages {
        if message.outbox_id() == odd {
            assert_eq!(message.subject, format!("{}.dlq", case.prefix));
            let reason = message.header("Outbox-Dead-Letter-Reason");
            assert!(reason.contains(because), "the reason says why: {reason}");
        } else {
            assert_matches_row(case, message, &table[&message.outbox_id()]);
        }
    }
    assert!(
        messages
            .windows(2)
            .all(|w| (w[0].commit_lsn(), w[0].tx_index()) < (w[1].commit_lsn(), w[1].tx_index())),
        "positions strictly increase along the stream"
    );
    eprintln!(
        "{}: {} rows, row {odd} dead-lettered in place ({because}); lost 0, duplicated 0, reordered 0; slot confirmed past {last_commit}",
        case.name,
        all.len()
    );
    messages
}

/// Waits for the relay to stop on its own; asserts it failed naming every one of `names`,
/// the stream holds `before` (nothing after), and the slot did not confirm past it.
async fn halted_naming(
    relay: &mut Process,
    case: &Case,
    js: &jetstream::Context,
    sql: &tokio_postgres::Client,
    before: &[i64],
    names: &[String],
) {
    let status = tokio::task::block_in_place(|| relay.wait_exit(DEADLINE));
    let output = relay.output();
    assert!(!status.success(), "halts: {status:?}\n{output}");
    for name in names {
        assert!(output.contains(name.as_str()), "names {name:?}:\n{output}");
    }
    let messages = case.messages(js).await;
    let ids: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    assert_eq!(ids, before, "everything before the event, nothing after");
    let confirmed = case.confirmed_flush_lsn(sql).await;
    let odd_commit = messages.last().map(Stored::commit_lsn).unwrap();
    assert!(
        confirmed <= odd_commit,
        "the slot confirmed {confirmed}, past the halted event's transaction"
    );
}

/// The relay's log shows no failed session: each odd event cost no reconnect loop.
fn no_failed_session(relay: &Process) {
    let output = relay.output();
    assert!(
        !output.contains("relay session ended"),
        "no session failed:\n{output}"
    );
}

/// A relay on its own server (the account, with `permissions`), with `env`, that was
/// given three transactions with one odd row (`odd`).
struct Run {
    case: Case,
    relay: Process,
    js: jetstream::Context,
    sql: tokio_postgres::Client,
    all: Vec<i64>,
    odd: i64,
    // Declared last: the server goes after the relay, its directory after it.
    _nats: Nats,
    _dir: tempfile::TempDir,
}

impl Run {
    async fn start(name: &str, permissions: &str, env: &[(&str, &str)], odd: (&str, i32)) -> Run {
        let dir = tempfile::Builder::new()
            .prefix("nats-conformance-")
            .tempdir()
            .unwrap();
        let nats = nats_with_account(dir.path(), permissions);
        Run::on(nats, dir, Login::user(), name, env, odd).await
    }

    /// A run on `nats` (its files in `dir`), the relay logging in with `login`.
    async fn on(
        nats: Nats,
        dir: tempfile::TempDir,
        login: Login,
        name: &str,
        env: &[(&str, &str)],
        odd: (&str, i32),
    ) -> Run {
        let mut case = Case::new(pg(), &nats, name);
        case.extra_env.extend(login.env);
        case.extra_env
            .extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        let relay = tokio::task::block_in_place(|| case.start_relay());
        let js = jetstream::new(
            login
                .client
                .connect(nats.url())
                .await
                .expect("the test's client connects"),
        );
        let mut sql = case.sql().await;
        let (all, odd) = write_with_one_odd_row(&mut sql, odd).await;
        Run {
            case,
            relay,
            js,
            sql,
            all,
            odd,
            _nats: nats,
            _dir: dir,
        }
    }

    /// [`dead_lettered_in_place`], without a failed session.
    async fn dead_lettered(&self, because: &str) {
        dead_lettered_in_place(
            &self.case,
            &self.js,
            &self.sql,
            (&self.all, self.odd),
            because,
        )
        .await;
        no_failed_session(&self.relay);
    }

    /// [`halted_naming`] the odd row and `names`.
    async fn halted(&mut self, names: &[&str]) {
        let at = self.all.iter().position(|&id| id == self.odd).unwrap();
        let mut names: Vec<String> = names.iter().map(|&n| n.to_owned()).collect();
        names.push(format!("outbox event id={}", self.odd));
        halted_naming(
            &mut self.relay,
            &self.case,
            &self.js,
            &self.sql,
            &self.all[..at],
            &names,
        )
        .await;
    }
}

const DEAD_LETTER: &[(&str, &str)] = &[("OUTBOX_RELAY_ON_POISON", "dead-letter")];

/// Issue 20, case 1: an event over the account's `max_payload` (announced in the INFO after
/// CONNECT) is dead-lettered naming its id, the events after it flow once, in order, the
/// slot moves; the relay never loops on "Maximum Payload Violation".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_accounts_max_payload_is_dead_lettered_in_place() {
    let run = Run::start("account_limit_dlq", "", DEAD_LETTER, ("OrderPaid", 8192)).await;
    run.dead_lettered(&ACCOUNT_MAX_PAYLOAD.to_string()).await;
    assert!(
        !run.relay.output().contains("Maximum Payload Violation"),
        "the event was never sent"
    );
}

/// Issue 20, case 1 with an operator/JWT account whose `payload` limit is below the
/// server's (what hosted NATS and decentralised set-ups do): the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_a_jwt_accounts_max_payload_is_dead_lettered_in_place() {
    let dir = tempfile::Builder::new()
        .prefix("nats-conformance-")
        .tempdir()
        .unwrap();
    let limit = i64::try_from(ACCOUNT_MAX_PAYLOAD).unwrap();
    let (config, account) = operator_config(dir.path(), limit);
    let path = dir.path().join("nats-server.conf");
    std::fs::write(&path, config).unwrap();
    let nats = Nats::start_with_args(&["-c", path.to_str().unwrap()]);
    let creds_text = creds(&account, &nkeys::KeyPair::new_user());
    let creds_file = dir.path().join("relay.creds");
    std::fs::write(&creds_file, &creds_text).unwrap();
    let login = Login {
        env: vec![(
            "OUTBOX_RELAY_NATS_CREDS".into(),
            creds_file.to_str().unwrap().into(),
        )],
        client: async_nats::ConnectOptions::with_credentials(&creds_text).unwrap(),
    };
    let run = Run::on(
        nats,
        dir,
        login,
        "jwt_limit_dlq",
        DEAD_LETTER,
        ("OrderPaid", 8192),
    )
    .await;
    run.dead_lettered(&ACCOUNT_MAX_PAYLOAD.to_string()).await;
}

/// Issue 20, case 1 under `halt`: the relay stops naming the event; nothing after it is in
/// the stream or confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_accounts_max_payload_halts_naming_it() {
    let mut run = Run::start("account_limit_halt", "", &[], ("OrderPaid", 8192)).await;
    run.halted(&[&ACCOUNT_MAX_PAYLOAD.to_string()]).await;
}

/// Permissions denying one event type's subject: `{prefix}.{shard}.Forbidden`, the case's
/// prefix being two tokens (`t{n}.{name}`).
const DENY_FORBIDDEN: &str = r#", permissions: { publish: { deny: ["*.*.*.Forbidden"] } }"#;

/// Issue 20, case 2: a publish the user may not make (`Permissions Violation for Publish
/// to`, the connection stays open) goes to the poison policy for that event: dead-lettered
/// in its place naming its subject, the rest stored once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_subject_is_denied_is_dead_lettered_in_place() {
    let run = Run::start("denied_dlq", DENY_FORBIDDEN, DEAD_LETTER, ("Forbidden", 10)).await;
    dead_lettered_in_place(
        &run.case,
        &run.js,
        &run.sql,
        (&run.all, run.odd),
        "Permissions Violation for Publish",
    )
    .await;
}

/// Issue 20, case 2 under `halt`: the relay stops naming the event and its subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_whose_subject_is_denied_halts_naming_it() {
    let mut run = Run::start("denied_halt", DENY_FORBIDDEN, &[], ("Forbidden", 10)).await;
    run.halted(&["Permissions Violation for Publish", ".Forbidden"])
        .await;
}

/// Which cluster node holds the relay's publishing connection (by its name in `/connz`).
fn publisher_node(cluster: &NatsCluster) -> Option<usize> {
    (0..3).find(|&i| {
        cluster.is_running(i)
            && cluster
                .monitor_get(i, "/connz")
                .is_ok_and(|(_, body)| body.contains("\"outbox-relay-publisher\""))
    })
}

/// Issue 20, case 3: the node holding the publishing connection goes into lame-duck mode
/// (`nats-server --signal ldm`) while writers commit: the session ends cleanly after its
/// acknowledgements (logged at info, no failed session), the next one publishes on another
/// node (the lame-duck one is dialled last), and the stream holds every committed row once,
/// in commit order. The relay dials in the order given (`--no-randomize`), a node that does
/// not lead the stream first: nats-server 2.12.8 stops JetStream on a node entering
/// lame-duck mode before it tells its clients, so with the stream's leader there, publishes
/// meet "no responders" until another node leads (a failed session, recovered; nothing
/// lost), which is the leader-loss case of tests/cluster.rs, not this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_in_lame_duck_mode_hands_the_session_over_without_a_failure() {
    let cluster = NatsCluster::start();
    let mut case = Case::with_nats_url(pg(), &cluster.urls(), "lame_duck");
    let servers: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
    let js = jetstream::new(
        async_nats::ConnectOptions::new()
            .connect(servers)
            .await
            .expect("connect to the cluster"),
    );
    let leader = case.create_r3_stream(&js, &cluster).await;
    let leader = cluster.node_index_by_name(&leader).unwrap();
    let node = (leader + 1) % 3;
    case.nats_url = [node, (node + 1) % 3, (node + 2) % 3]
        .map(|i| cluster.url(i))
        .join(",");
    case.set_env(&[("OUTBOX_RELAY_NATS_NO_RANDOMIZE", "true")]);
    // The test reads through the nodes that stay: a client on the lame duck would lose
    // JetStream with it.
    let js = jetstream::new(
        async_nats::ConnectOptions::new()
            .connect(vec![
                cluster.url((node + 1) % 3),
                cluster.url((node + 2) % 3),
            ])
            .await
            .expect("connect to the other nodes"),
    );
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let writers = Writers::start(&case, 2, Duration::from_millis(50)).await;
    case.wait_for_count(&js, 200, DEADLINE).await;
    assert_eq!(
        publisher_node(&cluster),
        Some(node),
        "--no-randomize: the first server given"
    );
    let before = case.stream_count(&js).await;
    cluster.lame_duck(node);
    let deadline = std::time::Instant::now() + DEADLINE;
    while !relay.output().contains("lame-duck mode") {
        assert!(
            std::time::Instant::now() < deadline,
            "the relay did not see node {node}'s lame-duck mode:\n{}\nnode {node}:\n{}",
            relay.output(),
            cluster.log(node)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let moved = eventually(
        "the publishing connection on another node",
        DEADLINE,
        || async { publisher_node(&cluster).filter(|&n| n != node) },
    )
    .await;
    case.wait_for_count(&js, before + 200, DEADLINE).await;

    let log = writers.stop().await;
    let committed = log.committed_rows() as u64;
    case.wait_for_count(&js, committed, DEADLINE).await;
    let messages = case.messages(&js).await;
    let findings = check_faithful(&messages, &log);
    eprintln!(
        "lame_duck: node {node} into lame-duck mode with {before} stored; the publisher moved to node {moved}; {} rows committed; found {}",
        committed,
        findings.summary()
    );
    findings.assert_faithful();
    no_failed_session(&relay);
    drop(relay);
}

/// The name of a dual-stack NATS host whose IPv6 address is black-holed: it resolves to
/// `[::1]` first (IPv6 is preferred), where nothing answers, then to `127.0.0.1`, where the
/// server listens.
const DUAL_STACK_HOST: &str = "nats-dual-stack.outbox-relay.test";

/// A listener at `address` that never accepts, its accept queue full, so that the kernel
/// drops every further SYN: a connection attempt there hangs until its timeout, as towards a
/// black-holed route. Keep what it returns alive for as long as the hole should be there.
async fn black_hole(address: std::net::SocketAddr) -> Vec<Box<dyn std::any::Any + Send>> {
    let socket = if address.is_ipv6() {
        tokio::net::TcpSocket::new_v6()
    } else {
        tokio::net::TcpSocket::new_v4()
    }
    .unwrap();
    socket.bind(address).unwrap();
    let listener = socket.listen(0).unwrap();
    let mut kept: Vec<Box<dyn std::any::Any + Send>> = vec![Box::new(listener)];
    loop {
        let attempt = tokio::net::TcpStream::connect(address);
        match tokio::time::timeout(Duration::from_millis(300), attempt).await {
            Ok(Ok(tcp)) => kept.push(Box::new(tcp)),
            Ok(Err(e)) => panic!("the black hole at {address} refused: {e}"),
            Err(_) => return kept,
        }
        assert!(
            kept.len() < 16,
            "the accept queue at {address} never filled"
        );
    }
}

/// `unshare --mount` around the relay with `hosts` bound over `/etc/hosts`: the relay alone
/// resolves [`DUAL_STACK_HOST`], nothing on the machine changes. Needs root (as CI runs).
fn with_hosts_file(hosts: &Path) -> Vec<String> {
    let probe = std::process::Command::new("unshare")
        .args(["--mount", "true"])
        .output()
        .expect("unshare (util-linux) runs");
    assert!(
        probe.status.success(),
        "this test runs the relay in a mount namespace of its own (`unshare --mount`), which \
         needs root (CI runs as root): {}",
        String::from_utf8_lossy(&probe.stderr)
    );
    [
        "unshare",
        "--mount",
        "sh",
        "-c",
        r#"mount --bind "$0" /etc/hosts && exec "$@""#,
    ]
    .into_iter()
    .map(str::to_owned)
    .chain([hosts.to_str().unwrap().to_owned()])
    .collect()
}

/// Issue 20, case 4: a NATS hostname whose first address silently drops connection attempts
/// (a dual-stack host with broken IPv6) is dialled at its next address, each with its own
/// timeout (sink CN9): both of the relay's connections reach the server, the publishing one
/// logs which address failed and why, and every event is stored once, in commit order, with
/// no failed session. (With one timeout for all of a host's addresses, the publishing
/// connection spent it on the first and every session failed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostname_whose_first_address_is_black_holed_is_dialled_at_the_next() {
    let nats = Nats::start();
    let hole = std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, nats.port()));
    let _hole = black_hole(hole).await;
    let dir = tempfile::Builder::new()
        .prefix("nats-dual-stack-")
        .tempdir()
        .unwrap();
    let hosts = dir.path().join("hosts");
    let system = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    std::fs::write(
        &hosts,
        format!("{system}\n::1 {DUAL_STACK_HOST}\n127.0.0.1 {DUAL_STACK_HOST}\n"),
    )
    .unwrap();

    let mut case = Case::with_nats_url(
        pg(),
        &format!("nats://{DUAL_STACK_HOST}:{}", nats.port()),
        "dual_stack",
    );
    case.relay_wrapper = with_hosts_file(&hosts);
    let relay = tokio::task::block_in_place(|| case.start_relay());
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let mut sql = case.sql().await;
    let mut all = Vec::new();
    for tag in ["first", "second", "third"] {
        all.extend(insert(&mut sql, &[("OrderPaid", 10); 4], tag).await);
    }
    let (messages, last_commit) = case.wait_confirmed(&js, &sql, all.len() as u64).await;
    let ids: Vec<i64> = messages.iter().map(Stored::outbox_id).collect();
    assert_eq!(ids, all, "every row once, in commit order");
    let table = rows_by_id(&sql).await;
    for message in &messages {
        assert_matches_row(&case, message, &table[&message.outbox_id()]);
    }
    let output = relay.output();
    assert!(
        output.contains("trying the next address of the host")
            && output.contains(&hole.to_string())
            && output.contains("no answer within"),
        "the publishing connection names the address that failed and why:\n{output}"
    );
    no_failed_session(&relay);
    eprintln!(
        "dual_stack: {hole} black-holed, {} rows stored once, in order, through 127.0.0.1; slot confirmed past {last_commit}",
        all.len()
    );
    drop(relay);
}
