//! The servers of one benchmark run and the per-scenario *cases* on them.
//!
//! One throwaway Postgres 15 (`wal_level=logical`, plus the load settings of
//! [`PG_SETTINGS`]) and one `nats-server -js` (file storage) serve the whole run. Every
//! scenario of every run gets a fresh [`Case`], testkit's test case: its own database with
//! the seed's table, its own slot(s), publication, stream and subject prefix, all removed
//! when it is done, so no scenario sees another's data, WAL or stream; the relay runs on
//! it exactly as in the end-to-end tests, as the binary being measured.

use std::ops::Deref;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use async_nats::jetstream;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use testkit::harness::{self, sql_connect};
use testkit::{Nats, PgOptions, Postgres};

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
    /// `--metrics`: the port the relay serves its metrics on, scraped while it drains.
    pub metrics_port: Option<u16>,
    /// A connection to the `postgres` database, for creating and dropping databases.
    pub admin: tokio_postgres::Client,
    /// A JetStream context for creating, inspecting and deleting streams.
    pub js: jetstream::Context,
}

/// One scenario's slice of the servers: testkit's case, set up to run the relay being
/// measured, and a connection to its database. Its prefix is `t{n}.bench`; the ceilings'
/// streams take the same prefix with another first letter, so all subjects of a case have
/// the same length.
#[derive(Debug)]
pub struct Case {
    pub relay: harness::Case,
    /// A connection to the case's database.
    pub sql: tokio_postgres::Client,
}

impl Deref for Case {
    type Target = harness::Case;

    fn deref(&self) -> &harness::Case {
        &self.relay
    }
}

/// Connects to Postgres without TLS, driving the connection on its own task.
pub async fn connect_sql(url: &str) -> Result<tokio_postgres::Client> {
    sql_connect(url)
        .await
        .with_context(|| format!("connect to {url}"))
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
            metrics_port: None,
            admin,
            js: jetstream::new(client),
        })
    }

    /// A fresh database with the seed's table, and fresh names for everything else; the
    /// relay of the case is `relay_bin` (behind `relay_wrapper`), logging at `info`, with
    /// `relay_env`.
    pub async fn case(&mut self, name: &str) -> Result<Case> {
        let nats_url = self.nats.url();
        // Named `bench` (prefix `t{n}.bench`): every case's subjects have the same length.
        let mut relay = tokio::task::block_in_place(|| {
            harness::Case::with_nats_url(&self.pg, &nats_url, "bench")
        });
        relay.name = name.to_owned();
        relay.relay_bin = self.relay_bin.clone();
        relay.relay_wrapper = self.relay_wrapper.clone();
        relay.extra_env.push(("RUST_LOG".into(), "info".into()));
        relay.extra_env.extend(self.relay_env.iter().cloned());
        let sql = connect_sql(&relay.pg_url).await?;
        Ok(Case { relay, sql })
    }

    /// Removes the case's slots, database and the given streams.
    pub async fn drop_case(&self, case: Case, streams: &[&str]) -> Result<()> {
        let Case { relay, sql } = case;
        drop(sql);
        let database = relay.database;
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

    /// `outbox-relay init`: the publication, the slot and the stream, before any backlog.
    pub fn relay_init(&self, case: &Case) -> Result<()> {
        let output = case
            .relay_command("init")
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
    match explicit {
        Some(path) => Ok(path),
        None => harness::built_relay(Some("release"), env!("CARGO_PKG_NAME"))
            .map_err(anyhow::Error::msg),
    }
}
