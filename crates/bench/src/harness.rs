//! The servers of one benchmark run and the per-scenario *cases* on them.
//!
//! One throwaway Postgres 15 (`wal_level=logical`, plus the load settings of
//! [`PG_SETTINGS`]) and one `nats-server -js` (file storage) serve the whole run. Every
//! scenario of every run gets a fresh [`Case`]: its own database with the seed's table, its
//! own slot(s), publication, stream and subject prefix, all removed when it is done, so no
//! scenario sees another's data, WAL or stream.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use testkit::{Nats, PgOptions, Postgres, Process};

/// The seed's schema (`sql/schema.sql`), applied to every case's database.
pub const SCHEMA_SQL: &str = include_str!("../../../sql/schema.sql");

/// Server settings for loading and streaming large backlogs: no checkpoint in the middle
/// of a load, room for the pages, Postgres's default `wal_sender_timeout` (testkit's is
/// shorter for its fault tests), and no autovacuum worker stealing a core mid-measurement.
pub const PG_SETTINGS: &[(&str, &str)] = &[
    ("max_wal_size", "16GB"),
    ("checkpoint_timeout", "1h"),
    ("shared_buffers", "512MB"),
    ("wal_sender_timeout", "60s"),
    ("autovacuum", "off"),
];

/// The stream's duplicate window, as the relay creates it by default (`2m`).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Servers, clients and settings shared by all scenarios.
#[derive(Debug)]
pub struct Bench {
    pub pg: Postgres,
    pub nats: Nats,
    pub relay_bin: PathBuf,
    /// Prefix for `outbox-relay run` (e.g. `valgrind --tool=callgrind`), for profiling.
    pub relay_wrapper: Vec<String>,
    /// Extra environment for the relay (`--relay-env`).
    pub relay_env: Vec<(String, String)>,
    /// A connection to the `postgres` database, for creating and dropping databases.
    pub admin: tokio_postgres::Client,
    /// A JetStream context for creating, inspecting and deleting streams.
    pub js: jetstream::Context,
    cases: usize,
}

/// One scenario's slice of the servers.
#[derive(Debug)]
pub struct Case {
    pub name: String,
    pub database: String,
    pub url: String,
    pub slot: String,
    pub publication: String,
    pub stream: String,
    pub prefix: String,
    /// A connection to the case's database.
    pub sql: tokio_postgres::Client,
}

/// Connects to Postgres without TLS, driving the connection on its own task.
pub async fn connect_sql(url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connect to {url}"))?;
    tokio::spawn(async move {
        // The connection ends with an error when the server drops it; the client's next
        // query reports that.
        let _ = connection.await;
    });
    Ok(client)
}

impl Bench {
    /// Starts the servers.
    pub async fn start(
        relay_bin: PathBuf,
        relay_wrapper: Vec<String>,
        relay_env: Vec<(String, String)>,
    ) -> Result<Bench> {
        let settings = PG_SETTINGS
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let pg = tokio::task::spawn_blocking(move || {
            Postgres::start_with(PgOptions {
                settings,
                ..Default::default()
            })
        })
        .await
        .context("starting Postgres")?;
        let nats = tokio::task::spawn_blocking(Nats::start)
            .await
            .context("starting nats-server")?;
        let admin = connect_sql(&pg.url("postgres")).await?;
        let client = async_nats::connect(nats.url())
            .await
            .context("connect to nats-server")?;
        Ok(Bench {
            pg,
            nats,
            relay_bin,
            relay_wrapper,
            relay_env,
            admin,
            js: jetstream::new(client),
            cases: 0,
        })
    }

    /// A fresh database with the seed's table, and fresh names for everything else.
    pub async fn case(&mut self, name: &str) -> Result<Case> {
        self.cases += 1;
        let n = self.cases;
        let database = format!("bench_{name}_{n}");
        self.admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await
            .with_context(|| format!("create database {database}"))?;
        let url = self.pg.url(&database);
        let sql = connect_sql(&url).await?;
        sql.batch_execute(SCHEMA_SQL)
            .await
            .context("apply sql/schema.sql")?;
        Ok(Case {
            name: name.to_owned(),
            slot: format!("relay_{database}"),
            publication: format!("pub_{database}"),
            stream: format!("BENCH_{}", database.to_uppercase()),
            // Subjects of every stream of a case have the same length: `{letter}{n}.bench`.
            prefix: format!("r{n}.bench"),
            url,
            database,
            sql,
        })
    }

    /// Removes the case's slots, database and the given streams.
    pub async fn drop_case(&self, case: Case, streams: &[&str]) -> Result<()> {
        let Case { database, sql, .. } = case;
        drop(sql);
        // A walsender may still be on its way out; wait until its slots are inactive.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let active: i64 = self
                .admin
                .query_one(
                    "select count(*) from pg_replication_slots where database = $1 and active",
                    &[&database],
                )
                .await?
                .get(0);
            if active == 0 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.admin
            .execute(
                "select pg_drop_replication_slot(slot_name) from pg_replication_slots where database = $1",
                &[&database],
            )
            .await
            .with_context(|| format!("drop the slots of {database}"))?;
        self.admin
            .batch_execute(&format!("DROP DATABASE {database} WITH (FORCE)"))
            .await
            .with_context(|| format!("drop database {database}"))?;
        for stream in streams {
            // A stream that was never created is fine.
            let _ = self.js.delete_stream(stream).await;
        }
        Ok(())
    }

    /// `outbox-relay <subcommand>` configured for `case` through environment variables
    /// (as `tests/support/mod.rs` does), wrapped in `--relay-wrapper` for `run`.
    pub fn relay_command(&self, case: &Case, subcommand: &str) -> Command {
        let mut command = match (subcommand, self.relay_wrapper.split_first()) {
            ("run", Some((program, args))) => {
                let mut command = Command::new(program);
                command.args(args).arg(&self.relay_bin);
                command
            }
            _ => Command::new(&self.relay_bin),
        };
        command.arg(subcommand);
        for (key, _) in std::env::vars() {
            if key.starts_with("OUTBOX_RELAY_") || key == "DATABASE_URL" || key == "NATS_URL" {
                command.env_remove(key);
            }
        }
        command
            .env("DATABASE_URL", &case.url)
            .env("NATS_URL", self.nats.url())
            .env("OUTBOX_RELAY_SLOT", &case.slot)
            .env("OUTBOX_RELAY_PUBLICATION", &case.publication)
            .env("OUTBOX_RELAY_STREAM", &case.stream)
            .env("OUTBOX_RELAY_SUBJECT_PREFIX", &case.prefix)
            .env("RUST_LOG", "info");
        for (key, value) in &self.relay_env {
            command.env(key, value);
        }
        command
    }

    /// `outbox-relay init`: the publication, the slot and the stream, before any backlog.
    pub fn relay_init(&self, case: &Case) -> Result<()> {
        let output = self
            .relay_command(case, "init")
            .output()
            .with_context(|| format!("run {} init", self.relay_bin.display()))?;
        if !output.status.success() {
            bail!(
                "outbox-relay init failed ({}):\n{}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(())
    }

    /// Spawns `outbox-relay run` for `case`.
    pub fn spawn_relay(&self, case: &Case) -> Process {
        Process::spawn(
            &format!("relay-{}", case.name),
            self.relay_command(case, "run"),
        )
    }

    /// Creates a pgoutput slot named `slot` in the case's database.
    pub async fn create_slot(&self, case: &Case, slot: &str) -> Result<()> {
        case.sql
            .query_one(
                "select pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&slot],
            )
            .await
            .with_context(|| format!("create slot {slot}"))?;
        Ok(())
    }

    /// The pid of the walsender serving `slot`, if one is active.
    pub async fn walsender_pid(&self, slot: &str) -> Result<Option<u32>> {
        let row = self
            .admin
            .query_opt(
                "select active_pid from pg_replication_slots where slot_name = $1",
                &[&slot],
            )
            .await?;
        Ok(row
            .and_then(|r| r.get::<_, Option<i32>>(0))
            .and_then(|pid| u32::try_from(pid).ok()))
    }

    /// Creates a stream like the relay's (file storage, 2 min duplicate window) for
    /// `{prefix}.>`.
    pub async fn create_stream(&self, name: &str, prefix: &str) -> Result<()> {
        self.js
            .create_stream(StreamConfig {
                name: name.to_owned(),
                subjects: vec![format!("{prefix}.>")],
                storage: StorageType::File,
                duplicate_window: DUPLICATE_WINDOW,
                ..Default::default()
            })
            .await
            .with_context(|| format!("create stream {name}"))?;
        Ok(())
    }

    /// The number of messages the stream holds.
    pub async fn stream_count(&self, name: &str) -> Result<u64> {
        let stream = self
            .js
            .get_stream(name)
            .await
            .with_context(|| format!("look up stream {name}"))?;
        Ok(stream.cached_info().state.messages)
    }

    /// Where `pg_recvlogical` lives.
    pub fn pg_bin(&self, name: &str) -> PathBuf {
        self.pg.bin_dir().join(name)
    }
}

/// The relay binary to measure: `--relay-bin`, else `outbox-relay` of the *release*
/// profile next to this executable (`target/release/`, also when the bench itself was
/// built in another profile). When run by cargo (`CARGO` is set), it is built first
/// (a no-op when up to date), so `cargo run --release -p outbox-relay-bench` is one command.
pub fn locate_relay(explicit: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locate the bench executable")?;
    let profile_dir = exe
        .parent()
        .context("the bench executable has no parent directory")?;
    let release_dir: PathBuf = if profile_dir.file_name().is_some_and(|n| n == "release") {
        profile_dir.to_path_buf()
    } else {
        profile_dir
            .parent()
            .map(|target| target.join("release"))
            .context("no target directory above the bench executable")?
    };
    let relay = release_dir.join("outbox-relay");
    if let Ok(cargo) = std::env::var("CARGO") {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        eprintln!("bench: cargo build --release -p outbox-relay");
        let status = Command::new(cargo)
            .args(["build", "--release", "-p", "outbox-relay"])
            .current_dir(&workspace)
            .status()
            .context("run cargo build --release -p outbox-relay")?;
        if !status.success() {
            bail!("cargo build --release -p outbox-relay failed ({status})");
        }
    }
    if !relay.is_file() {
        bail!(
            "{} does not exist: build it with `cargo build --release -p outbox-relay`, or pass --relay-bin",
            relay.display()
        );
    }
    Ok(relay)
}
