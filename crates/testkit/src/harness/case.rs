//! A test *case*: one database (with the seed's table), one slot, one publication, one
//! stream and one subject prefix on shared or private servers, and the real `outbox-relay`
//! binary configured for them through its environment.

use std::ffi::OsStr;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use pgoutput::Lsn;

use super::logs::STREAMING;
use super::stream::{read_stream, Stored};
pub use crate::process::succeeds;
use crate::{Nats, PgOptions, Postgres, Process};

/// The seed's schema, applied to every case's database.
pub const SCHEMA_SQL: &str = include_str!("../../../../sql/schema.sql");
/// The optional key-filling trigger.
pub const TRIGGER_SQL: &str = include_str!("../../../../sql/trigger.sql");

/// How long any single wait may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Waits until `check` returns `Some`, polling every 50 ms; panics after `timeout` naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A JetStream context on the NATS server(s) at `url` (e.g. bypassing a case's proxy).
pub async fn jetstream_at(url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(url).await.expect("connect to NATS"))
}

/// A JetStream context whose requests give up after a second (for tests that poll through
/// nats-server restarts).
pub async fn jetstream_with_timeout(url: &str) -> jetstream::Context {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(client)
}

/// A SQL connection, retried until [`DEADLINE`] (Postgres may be restarting).
pub async fn sql_connect_retrying(url: &str) -> tokio_postgres::Client {
    eventually("a SQL connection", DEADLINE, || async {
        sql_connect(url).await.ok()
    })
    .await
}

/// A SQL connection (no TLS) whose connection task runs on its own; the error when Postgres
/// is unreachable or refuses.
pub async fn sql_connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        // It ends with an error when the server goes away; the client's next query says so.
        let _ = connection.await;
    });
    Ok(client)
}

/// A Postgres and a nats-server shared by the tests of one test binary.
#[derive(Debug)]
pub struct Servers {
    pub pg: Postgres,
    pub nats: Nats,
}

/// This test binary's shared servers, started on first use (each test binary links its own
/// testkit, so each gets its own pair). Every case on them creates a slot and leaves it (a
/// test may read it after its relay stopped), and one binary holds the cases of the whole
/// end-to-end suite (`tests/e2e.rs`): the Postgres has room for [`SHARED_SLOTS`] of them.
pub fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    crate::shared(&SERVERS, || Servers {
        pg: Postgres::start_with(PgOptions {
            settings: vec![("max_replication_slots".into(), SHARED_SLOTS.to_string())],
            ..PgOptions::default()
        }),
        nats: Nats::start(),
    })
}

/// A [`Case`] named `name` on this test binary's shared [`servers`].
pub fn new_case(name: &str) -> Case {
    let s = servers();
    Case::new(&s.pg, &s.nats, name)
}

/// Runs `command` to its end and asserts that it exited with status `code`; returns its
/// stderr (the failure's message).
pub fn exits_with(command: &mut Command, code: i32) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("run {command:?}: {e}"));
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(code), "{stderr}");
    stderr
}

/// What [`Case::relay_transaction`] leaves running: the relay, the SQL connection that
/// committed the transaction, a JetStream context and the transaction's ids.
#[derive(Debug)]
pub struct Relayed {
    pub relay: Process,
    pub sql: tokio_postgres::Client,
    pub js: jetstream::Context,
    pub ids: Vec<i64>,
}

/// The replication slots the shared Postgres has room for: more than the end-to-end suite's
/// cases on it (about 100), which do not drop theirs.
const SHARED_SLOTS: u32 = 400;

/// The `outbox-relay` binary a new [`Case`] runs: `$OUTBOX_RELAY_BIN` when set; else the one
/// cargo built for the running integration test (`CARGO_BIN_EXE_outbox-relay`, in the
/// environment of the outbox-relay package's tests since cargo 1.94); else `outbox-relay`
/// in the target directory the running executable was built into, where cargo puts it
/// (`target/<profile>/`, above a test binary's `deps/`). Whether it exists is checked when
/// a case runs it.
pub fn relay_bin() -> PathBuf {
    if let Some(path) = ["OUTBOX_RELAY_BIN", "CARGO_BIN_EXE_outbox-relay"]
        .iter()
        .find_map(std::env::var_os)
    {
        return PathBuf::from(path);
    }
    target_profile_dir().join("outbox-relay")
}

/// The directory cargo built the running executable into: `target/<profile>` (also for a
/// test binary, which lives in its `deps/`).
pub fn target_profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("testkit: locate the running executable");
    let dir = exe
        .parent()
        .expect("testkit: the running executable has no parent directory");
    if dir.file_name().is_some_and(|name| name == "deps") {
        dir.parent().unwrap_or(dir).to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

/// `{wrapper…} {bin} {subcommand}` configured by `env` alone: none of this process's own
/// relay settings (`OUTBOX_RELAY_*`, `DATABASE_URL`, `NATS_URL`) leak in.
pub fn relay_command<K, V>(
    bin: &Path,
    wrapper: &[String],
    subcommand: &str,
    env: impl IntoIterator<Item = (K, V)>,
) -> Command
where
    K: AsRef<OsStr>,
    V: AsRef<OsStr>,
{
    assert!(
        bin.is_file(),
        "testkit: the relay binary {} does not exist: build it with `cargo build -p outbox-relay` \
         (tests of the outbox-relay package get it built by cargo), or point OUTBOX_RELAY_BIN at it",
        bin.display()
    );
    let mut command = match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(bin);
            command
        }
        None => Command::new(bin),
    };
    command.arg(subcommand);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("OUTBOX_RELAY_") || key == "DATABASE_URL" || key == "NATS_URL" {
            command.env_remove(key.as_ref());
        }
    }
    command.envs(env);
    command
}

/// `outbox-relay` of cargo profile `profile` (`None`: the running executable's own) in the
/// running executable's target directory, built first when this runs under cargo (`CARGO`
/// is set, as with `cargo run`): how the demo and the benchmark find the relay they run.
/// `with` is the running package: it is built alongside (`-p outbox-relay -p {with}`), so
/// that cargo unifies the dependencies' features as it did for the running package when
/// that one depends on the relay crate, and compiles nothing a second time.
pub fn built_relay(profile: Option<&str>, with: &str) -> Result<PathBuf, String> {
    let own = target_profile_dir();
    let own_name = own
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Cargo's `dev` and `test` profiles build into `debug/`.
    let profile = profile.unwrap_or(match own_name.as_str() {
        "debug" => "dev",
        name => name,
    });
    let directory = match profile {
        "dev" | "test" => "debug",
        name => name,
    };
    let relay = own.with_file_name(directory).join("outbox-relay");
    if let Some(cargo) = std::env::var_os("CARGO") {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        eprintln!("cargo build --profile {profile} -p outbox-relay -p {with}");
        let status = Command::new(cargo)
            .args([
                "build",
                "--profile",
                profile,
                "-p",
                "outbox-relay",
                "-p",
                with,
            ])
            .current_dir(&workspace)
            .status()
            .map_err(|e| format!("cannot run cargo build -p outbox-relay: {e}"))?;
        if !status.success() {
            return Err(format!(
                "cargo build --profile {profile} -p outbox-relay failed ({status})"
            ));
        }
    }
    if !relay.is_file() {
        return Err(format!(
            "{} does not exist: build it with `cargo build --profile {profile} -p outbox-relay`",
            relay.display()
        ));
    }
    Ok(relay)
}

/// The server's current WAL insert position (`pg_current_wal_lsn()`).
pub async fn wal_lsn(sql: &tokio_postgres::Client) -> Lsn {
    sql.query_one("select pg_current_wal_lsn()::text", &[])
        .await
        .expect("pg_current_wal_lsn()")
        .get::<_, String>(0)
        .parse()
        .expect("an LSN")
}

/// One test's slice of the servers, and how to run the relay on it.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    pub database: String,
    pub pg_url: String,
    pub nats_url: String,
    pub stream: String,
    pub prefix: String,
    pub slot: String,
    pub publication: String,
    /// Environment for the relay, after the case's own (so it can override it).
    pub extra_env: Vec<(String, String)>,
    /// The relay binary ([`relay_bin`] unless changed).
    pub relay_bin: PathBuf,
    /// A command prefix for `outbox-relay run` (a profiler), usually empty.
    pub relay_wrapper: Vec<String>,
}

static CASE_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// `TESTKIT_RELAY_ENV`: `KEY=VALUE` pairs (whitespace-separated) every new [`Case`] starts its
/// `extra_env` with, to run a suite in another relay mode (e.g.
/// `OUTBOX_RELAY_ATOMIC_TRANSACTIONS=true`) without changing it; a case's own settings
/// come after them.
fn relay_env_for_every_case() -> Vec<(String, String)> {
    let pairs = std::env::var("TESTKIT_RELAY_ENV").unwrap_or_default();
    pairs
        .split_whitespace()
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) => (key.to_owned(), value.to_owned()),
            None => panic!("testkit: TESTKIT_RELAY_ENV holds {pair:?}, not KEY=VALUE"),
        })
        .collect()
}

impl Case {
    /// Whether the case's relay runs with `--atomic-transactions` (its `extra_env`, the last
    /// setting; `TESTKIT_RELAY_ENV` included).
    pub fn atomic_transactions(&self) -> bool {
        self.extra_env
            .iter()
            .rev()
            .find(|(key, _)| key == "OUTBOX_RELAY_ATOMIC_TRANSACTIONS")
            .is_some_and(|(_, value)| value == "true")
    }

    /// Creates a database with the seed's table on `pg`, and names for everything else.
    pub fn new(pg: &Postgres, nats: &Nats, name: &str) -> Case {
        Case::with_nats_url(pg, &nats.url(), name)
    }

    /// A database with the seed's table on `pg`, and names for everything else, for NATS at
    /// `nats_url` (several servers may be listed, comma-separated, e.g. a
    /// [`crate::cluster::NatsCluster`]). The prefix is `t{n}.{name}`: a prefix of the same
    /// length with another first letter names a sibling stream's subjects.
    pub fn with_nats_url(pg: &Postgres, nats_url: &str, name: &str) -> Case {
        let n = CASE_COUNTER.fetch_add(1, Ordering::Relaxed);
        let database = format!("{name}_{n}");
        pg.create_database(&database);
        pg.psql(&database, SCHEMA_SQL);
        Case {
            name: name.to_owned(),
            pg_url: pg.url(&database),
            nats_url: nats_url.to_owned(),
            stream: format!("OUTBOX_{}", database.to_uppercase()),
            prefix: format!("t{n}.{name}"),
            slot: format!("slot_{database}"),
            publication: format!("pub_{database}"),
            database,
            extra_env: relay_env_for_every_case(),
            relay_bin: relay_bin(),
            relay_wrapper: vec![],
        }
    }

    /// The relay binary (`run` behind [`Case::relay_wrapper`]), configured through
    /// environment variables for this case; none of the test process's own relay settings
    /// leak in.
    pub fn relay_command(&self, subcommand: &str) -> Command {
        let wrapper: &[String] = match subcommand {
            "run" => &self.relay_wrapper,
            _ => &[],
        };
        relay_command(&self.relay_bin, wrapper, subcommand, self.relay_env())
    }

    /// The environment that configures the relay for this case (`extra_env` last).
    pub fn relay_env(&self) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = [
            ("DATABASE_URL", &self.pg_url),
            ("NATS_URL", &self.nats_url),
            ("OUTBOX_RELAY_SLOT", &self.slot),
            ("OUTBOX_RELAY_PUBLICATION", &self.publication),
            ("OUTBOX_RELAY_STREAM", &self.stream),
            ("OUTBOX_RELAY_SUBJECT_PREFIX", &self.prefix),
            ("RUST_LOG", &"info,outbox_relay=debug".to_owned()),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value.clone()))
        .collect();
        env.extend(self.extra_env.iter().cloned());
        env
    }

    /// Adds `settings` to the relay's environment, after what it holds (so they override it).
    pub fn set_env(&mut self, settings: &[(&str, &str)]) {
        self.extra_env.extend(
            settings
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned())),
        );
    }

    /// Starts a [`crate::Proxy`] in front of the nats-server at `nats_port` on loopback
    /// and points the case's relay at it (the test's own clients can still go direct).
    pub fn nats_through_proxy(&mut self, nats_port: u16) -> crate::Proxy {
        let proxy = crate::Proxy::start(([127, 0, 0, 1], nats_port).into());
        self.nats_url = format!("nats://127.0.0.1:{}", proxy.port());
        proxy
    }

    /// Runs `outbox-relay {subcommand}` to its end and asserts that it exited with status
    /// `code`; returns its stderr.
    pub fn relay_exits(&self, subcommand: &str, code: i32) -> String {
        exits_with(&mut self.relay_command(subcommand), code)
    }

    /// Runs `outbox-relay init` and asserts that it succeeded.
    pub fn init(&self) {
        succeeds(&mut self.relay_command("init"));
    }

    /// Creates the case's stream (its name, its prefix's subjects) with the rest of `config`,
    /// as an operator would before the relay's first start.
    pub async fn create_stream(
        &self,
        js: &jetstream::Context,
        config: jetstream::stream::Config,
    ) -> jetstream::stream::Stream {
        js.create_stream(jetstream::stream::Config {
            name: self.stream.clone(),
            subjects: vec![format!("{}.>", self.prefix)],
            ..config
        })
        .await
        .expect("create the stream")
    }

    /// Spawns `outbox-relay run` (named `relay-{name}`), without waiting for anything.
    pub fn spawn_relay(&self) -> Process {
        Process::spawn(&format!("relay-{}", self.name), self.relay_command("run"))
    }

    /// Starts `outbox-relay run` and waits until it streams.
    pub fn start_relay(&self) -> Process {
        let relay = self.spawn_relay();
        relay.wait_for_output(STREAMING, DEADLINE);
        relay
    }

    /// A SQL connection to the case's database.
    pub async fn sql(&self) -> tokio_postgres::Client {
        sql_connect(&self.pg_url)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.pg_url))
    }

    /// A JetStream context.
    pub async fn jetstream(&self) -> jetstream::Context {
        jetstream_at(&self.nats_url).await
    }

    /// The slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush_lsn(&self, sql: &tokio_postgres::Client) -> Lsn {
        let row = sql
            .query_one(
                "select confirmed_flush_lsn::text from pg_replication_slots where slot_name = $1",
                &[&self.slot],
            )
            .await
            .expect("slot exists");
        row.get::<_, Option<String>>(0)
            .unwrap_or_else(|| "0/0".into())
            .parse()
            .expect("lsn")
    }

    /// Creates the case's stream on `cluster` with three replicas (file storage) and waits
    /// until it has a leader: returns the leader's name.
    pub async fn create_r3_stream(
        &self,
        js: &jetstream::Context,
        cluster: &crate::cluster::NatsCluster,
    ) -> String {
        js.create_stream(jetstream::stream::Config {
            name: self.stream.clone(),
            subjects: vec![format!("{}.>", self.prefix)],
            num_replicas: 3,
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("create the R3 stream");
        if self.atomic_transactions() {
            self.allow_atomic(js).await;
        }
        eventually("the R3 stream to have a leader", DEADLINE, || async {
            cluster.stream_leader(&self.stream)
        })
        .await
    }

    /// Sets `allow_atomic` on the case's stream (through the API's JSON: async-nats has it
    /// only behind a feature the workspace does not enable), for a relay with
    /// `--atomic-transactions` on a stream the test created.
    pub async fn allow_atomic(&self, js: &jetstream::Context) {
        let info: serde_json::Value = js
            .request(
                format!("STREAM.INFO.{}", self.stream),
                &serde_json::json!({}),
            )
            .await
            .expect("read the stream's configuration");
        let mut config = info["config"].clone();
        config["allow_atomic"] = serde_json::Value::Bool(true);
        let answer: serde_json::Value = js
            .request(format!("STREAM.UPDATE.{}", self.stream), &config)
            .await
            .expect("update the stream");
        assert!(answer.get("error").is_none(), "allow_atomic: {answer}");
    }

    /// The number of messages in the stream (0 if it does not exist yet).
    pub async fn stream_count(&self, js: &jetstream::Context) -> u64 {
        match js.get_stream(&self.stream).await {
            Ok(stream) => stream.cached_info().state.messages,
            Err(_) => 0,
        }
    }

    /// Waits until the stream holds at least `n` messages.
    pub async fn wait_for_count(&self, js: &jetstream::Context, n: u64, timeout: Duration) {
        eventually(
            &format!("{n} messages in stream {}", self.stream),
            timeout,
            || async { (self.stream_count(js).await >= n).then_some(()) },
        )
        .await;
    }

    /// Waits until the stream holds at least `n` messages and the slot confirmed past the
    /// last one's commit; returns the messages and that commit LSN.
    pub async fn wait_confirmed(
        &self,
        js: &jetstream::Context,
        sql: &tokio_postgres::Client,
        n: u64,
    ) -> (Vec<Stored>, Lsn) {
        self.wait_for_count(js, n, DEADLINE).await;
        let what = format!("the slot to confirm the last of {n} messages");
        eventually(&what, DEADLINE, || async {
            let messages = self.messages(js).await;
            let last = messages.last()?.commit_lsn();
            (self.confirmed_flush_lsn(sql).await > last).then_some((messages, last))
        })
        .await
    }

    /// The `Outbox-Id` of every message in the stream, in stream order.
    pub async fn outbox_ids(&self, js: &jetstream::Context) -> Vec<i64> {
        self.messages(js)
            .await
            .iter()
            .map(Stored::outbox_id)
            .collect()
    }

    /// Every message in the stream, in stream order.
    pub async fn messages(&self, js: &jetstream::Context) -> Vec<Stored> {
        let stream = js.get_stream(&self.stream).await.expect("stream exists");
        let total = stream.cached_info().state.messages;
        read_stream(js, &self.stream, total, DEADLINE).await
    }
}

/// Asserts that the relay's sessions on the case's database (replication and lease, at
/// least two) use TLS; psql's own session does not count.
pub fn assert_relay_sessions_use_tls(pg: &Postgres, case: &Case) {
    let encrypted: i64 = pg
        .psql(
            &case.database,
            "select count(*) from pg_stat_ssl s join pg_stat_activity a using (pid) \
             where s.ssl and a.application_name not in ('psql', 'testkit-psql')",
        )
        .parse()
        .expect("a count");
    assert!(
        encrypted >= 2,
        "replication and lease sessions use TLS ({encrypted})"
    );
}

/// Inserts one outbox row as `pg`'s superuser (whatever credentials the relay uses) and
/// waits until the case's stream holds it.
pub async fn relay_one_row_as_superuser(pg: &Postgres, case: &Case) {
    let (sql, connection) = tokio_postgres::connect(&pg.url(&case.database), tokio_postgres::NoTls)
        .await
        .expect("connect as the superuser");
    tokio::spawn(connection);
    sql.batch_execute(
        "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload) values ('e', 'T', 'x', '', '', '{}')",
    )
    .await
    .expect("insert");
    let js = case.jetstream().await;
    case.wait_for_count(&js, 1, DEADLINE).await;
}

/// Runs the relay with `right` replaced by `wrong` in the case's DATABASE_URL: it must stop
/// (exit 1) saying that password authentication failed, printing neither password.
pub fn assert_wrong_password_fails_without_printing_it(case: &Case, right: &str, wrong: &str) {
    let mut case = case.clone();
    case.pg_url = case.pg_url.replace(right, wrong);
    let output = case.relay_command("run").output().expect("run the relay");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("password authentication failed"),
        "{stderr}"
    );
    assert!(
        !stderr.contains(wrong) && !stderr.contains(right),
        "{stderr}"
    );
}
