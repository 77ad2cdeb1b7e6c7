//! The outbox table's identity, watched while streaming (issue 18).
//!
//! The publication names tables by OID. When the outbox table is dropped and created again,
//! or another table is renamed into its place (the usual way to make it partitioned), the
//! publication still names the old OID: the new table's inserts are never decoded, the slot
//! keeps confirming idle positions, and nothing says so. So the relay keeps the identity it
//! streams and checks it again, beside the session, on the lease's connection
//! ([`crate::process::monitor`], every [`CHECK`]):
//!
//! - the table's OID (`'schema.table'::regclass`) and whether it is partitioned;
//! - the publication's OID, and that it still publishes inserts;
//! - that it still covers the table (`FOR TABLE`, the membership row's OID included, so a
//!   table dropped from the publication and added again is seen; `FOR ALL TABLES`; `FOR
//!   TABLES IN SCHEMA`), and `publish_via_partition_root` for a partitioned table.
//!
//! # Invariants
//! - TI1 Every session starts with a check ([`Watch::begin`], after the start-up checks of
//!   [`crate::postgres::checks`], before replication starts); its identity is the one the session
//!   streams, and the first session's is the one the process streams: a later session that
//!   finds another is refused like a change seen while streaming.
//! - TI2 Nothing is confirmed past what a check vouched for. A check is one simple query of
//!   two statements: `pg_current_wal_lsn()` first, then the identity, in a later statement
//!   and so a later snapshot. A check that finds the identity unchanged vouches for the LSN
//!   read by the previous passing check of the session (the session's first check vouches
//!   for nothing beyond the slot's position at start); the flush LSN the reader sends is
//!   the lower of the sink's watermark and the vouched LSN ([`Watch::vouched`], the same
//!   cap as `--mark-published`'s, `crate::process::mark` U2). A DDL that changes the identity and
//!   commits at or below a vouched LSN committed before the previous check began, so that
//!   check or this one sees it, unless the commit stayed invisible for a whole [`CHECK`]
//!   after its WAL was written (a synchronous standby that stalls). An insert into a new
//!   table commits after the DDL is visible, so above every LSN a check that did not see the
//!   DDL read: it is never confirmed.
//! - TI3 A change ends the session with a permanent error (the process exits non-zero,
//!   `/readyz` is not ready from the moment it is found) whose one line names the change
//!   (both OIDs, or what the publication lost), the position the slot is confirmed
//!   through, and the fix: `ALTER PUBLICATION … ADD TABLE …` when the publication does not
//!   cover the table; the relay started again (it resumes from before the change, and
//!   relays what the publication publishes); once caught up, `outbox-relay verify` for the
//!   rows the publication hid and `outbox-relay backfill --from-id … --to-id …` for them
//!   (rows the slot will never send, so the relay never streams them too); and
//!   docs/operations.md for the conversion to a partitioned table.
//!   A publication changed under the same table (inserts, coverage, via-root) is refused
//!   by [`crate::postgres::checks`]'s own check (PG3, exit status 2, with its exact SQL) when it
//!   hides inserts now, like at a session start.
//! - TI4 A check that fails to run (connection, timeout) vouches for nothing new and is
//!   retried at the next one; it never ends the session (like the monitor's poll, MON1).
//! - TI5 Retention deletes only from the OID the session streams ([`crate::process::retention`] RET7).

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use pgoutput::Lsn;
use replication::quote_literal;
use tokio::sync::watch;
use tokio_postgres::{Client, SimpleQueryMessage};

use crate::config::Config;
use crate::error::{RelayError, Result};

/// How often the identity is checked while streaming (TI2: the slot's confirmation trails
/// the sink's watermark by one to two checks).
pub const CHECK: Duration = Duration::from_secs(1);
/// How often while a shutdown drains, so that the final status confirms what was drained.
pub const CHECK_DRAINING: Duration = Duration::from_millis(100);

/// What the relay streams: the table and the publication as the catalog names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// `'schema.table'::regclass`; `None` when no such table exists.
    pub table_oid: Option<u32>,
    /// The table is partitioned.
    pub partitioned: bool,
    /// The publication's OID; `None` when no such publication exists.
    pub publication_oid: Option<u32>,
    /// `publish` includes `insert`.
    pub insert: bool,
    /// `publish_via_partition_root` (`false` before Postgres 13).
    pub via_root: bool,
    /// `FOR ALL TABLES`.
    pub all_tables: bool,
    /// The `pg_publication_rel` row that lists the table (`FOR TABLE`), by its OID.
    pub membership: Option<u32>,
    /// The publication lists the table's schema (`FOR TABLES IN SCHEMA`, Postgres 15+).
    pub schema_listed: bool,
}

impl Identity {
    /// Whether the publication publishes the table's inserts under its own name.
    fn publishes(&self) -> bool {
        self.table_oid.is_some()
            && self.publication_oid.is_some()
            && self.insert
            && (self.all_tables || self.membership.is_some() || self.schema_listed)
            && (!self.partitioned || self.via_root)
    }
}

/// The session's check (TI2): the WAL position, then the identity.
fn check_sql(config: &Config, version: i32) -> String {
    let table = quote_literal(config.table.sql());
    let publication = quote_literal(&config.publication);
    let via_root = if version >= 130_000 {
        "p.pubviaroot"
    } else {
        "false"
    };
    let schema_listed = if version >= 150_000 {
        "EXISTS (SELECT 1 FROM pg_catalog.pg_publication_namespace pn \
                  WHERE pn.pnpubid = p.oid AND pn.pnnspid = c.relnamespace)"
    } else {
        "false"
    };
    let position = crate::postgres::standby::wal_position!();
    format!(
        "SELECT {position}::text; \
         SELECT c.oid::int8, c.relkind = 'p', p.oid::int8, p.pubinsert, {via_root}, p.puballtables, \
                (SELECT pr.oid::int8 FROM pg_catalog.pg_publication_rel pr \
                  WHERE pr.prpubid = p.oid AND pr.prrelid = c.oid), \
                {schema_listed} \
           FROM (SELECT pg_catalog.to_regclass({table}) AS oid) t \
           LEFT JOIN pg_catalog.pg_class c ON c.oid = t.oid \
           LEFT JOIN pg_catalog.pg_publication p ON p.pubname = {publication}"
    )
}

/// Runs a check: the WAL position read first, and the identity after it (TI2).
async fn check(client: &Client, sql: &str) -> std::result::Result<(Lsn, Identity), String> {
    let messages = client
        .simple_query(sql)
        .await
        .map_err(|e| crate::postgres::error::describe(&e))?;
    let mut rows = messages.iter().filter_map(|message| match message {
        SimpleQueryMessage::Row(row) => Some(row),
        _ => None,
    });
    let (Some(lsn), Some(row)) = (rows.next(), rows.next()) else {
        return Err("the identity check returned no rows".to_owned());
    };
    let lsn: Lsn = lsn
        .get(0)
        .unwrap_or_default()
        .parse()
        .map_err(|e| format!("pg_current_wal_lsn: {e}"))?;
    let oid = |i: usize| row.get(i).and_then(|text| text.parse::<u32>().ok());
    let yes = |i: usize| row.get(i) == Some("t");
    Ok((
        lsn,
        Identity {
            table_oid: oid(0),
            partitioned: yes(1),
            publication_oid: oid(2),
            insert: yes(3),
            via_root: yes(4),
            all_tables: yes(5),
            membership: oid(6),
            schema_listed: yes(7),
        },
    ))
}

/// The identity watch of one `run`: what the process streams (TI1), and per session the
/// LSN the last passing check read and the vouched LSN (TI2).
#[derive(Debug)]
pub struct Watch {
    state: Mutex<State>,
    vouched: watch::Sender<Lsn>,
}

#[derive(Debug, Default)]
struct State {
    /// The check's SQL, built at the first session (it depends on the server's version).
    sql: Option<String>,
    /// The identity the process streams (TI1).
    streamed: Option<Identity>,
    /// The LSN read by the session's last passing check; `None` before the session began.
    read: Option<Lsn>,
    /// Counts the sessions begun, so that a check that straddles a session's start vouches
    /// for nothing.
    session: u64,
}

/// A check's outcome.
#[derive(Debug)]
pub enum Checked {
    /// The session has not begun: nothing to compare with.
    NotBegun,
    /// The identity is unchanged; the vouched LSN is now this.
    Vouched(Lsn),
    /// The check could not run (TI4).
    Failed(String),
}

impl Default for Watch {
    fn default() -> Self {
        Watch {
            state: Mutex::new(State::default()),
            vouched: watch::channel(Lsn::ZERO).0,
        }
    }
}

impl Watch {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The vouched LSN, for the reader's cap (TI2).
    pub fn vouched(&self) -> watch::Receiver<Lsn> {
        self.vouched.subscribe()
    }

    /// The OID of the table the process streams (TI5).
    pub fn table_oid(&self) -> Option<u32> {
        self.state().streamed.as_ref().and_then(|i| i.table_oid)
    }

    /// A session begins (TI1): checks the identity, which must be the one the process
    /// streamed, if any, and publish the table's inserts. Then [`Watch::resume_from`].
    pub async fn begin(&self, client: &Client, config: &Config) -> Result<()> {
        let known = {
            let mut state = self.state();
            state.read = None;
            state.session += 1;
            state.sql.clone()
        };
        let sql = match known {
            Some(sql) => sql,
            None => {
                let sql = check_sql(
                    config,
                    crate::postgres::checks::server_version(client).await?,
                );
                self.state().sql = Some(sql.clone());
                sql
            }
        };
        let (read, identity) = check(client, &sql).await.map_err(|e| {
            RelayError::transient(anyhow::anyhow!(
                "cannot check the identity of {}: {e}",
                config.table
            ))
        })?;
        let change = {
            let mut state = self.state();
            let streamed = state.streamed.get_or_insert_with(|| identity.clone());
            let change = Change::between(streamed, &identity).or_else(|| {
                (!identity.publishes()).then(|| Change {
                    what: format!(
                        "is not published under its own name by publication {:?} any more (changed during the start-up checks)",
                        config.publication
                    ),
                    fix_publication: true,
                    publication_only: true,
                })
            });
            if change.is_none() {
                state.read = Some(read);
            }
            change
        };
        match change {
            Some(change) => Err(self.refuse(client, config, &change, &identity).await),
            None => Ok(()),
        }
    }

    /// The refusal of `change` to `now` (TI3): a publication changed under the same table
    /// is refused by [`crate::postgres::checks`]'s check (PG3: exit status 2, the exact SQL) when
    /// it would hide inserts now; otherwise, and for a table replaced, by [`refusal`].
    async fn refuse(
        &self,
        client: &Client,
        config: &Config,
        change: &Change,
        now: &Identity,
    ) -> RelayError {
        if change.publication_only {
            if let Err(error) = crate::postgres::checks::publication(client, config).await {
                if !error.is_transient() {
                    return error;
                }
            }
        }
        refusal(config, change, now, *self.vouched.borrow())
    }

    /// The session streams from `confirmed`: the reader's cap starts there (TI2).
    pub fn resume_from(&self, confirmed: Lsn) {
        self.vouched.send_replace(confirmed);
    }

    /// Checks the identity of the running session (TI2, TI4); `Err`: it changed (TI3).
    pub async fn check(&self, client: &Client, config: &Config) -> Result<Checked> {
        // What the previous passing check read, taken before this check's query is sent:
        // only then did this check's identity statement run after that read (TI2).
        let (sql, previous, session) = {
            let state = self.state();
            match (&state.sql, state.read) {
                (Some(sql), Some(previous)) => (sql.clone(), previous, state.session),
                _ => return Ok(Checked::NotBegun),
            }
        };
        let (read, identity) = match tokio::time::timeout(CHECK * 5, check(client, &sql)).await {
            Ok(Ok(found)) => found,
            Ok(Err(error)) => return Ok(Checked::Failed(error)),
            Err(_) => return Ok(Checked::Failed("timed out".to_owned())),
        };
        let change = {
            let mut state = self.state();
            if state.session != session {
                // A session began meanwhile: its own check is the baseline.
                return Ok(Checked::NotBegun);
            }
            let Some(streamed) = &state.streamed else {
                return Ok(Checked::NotBegun);
            };
            let change = Change::between(streamed, &identity);
            if change.is_none() {
                state.read = Some(read.max(previous));
            }
            change
        };
        if let Some(change) = change {
            return Err(self.refuse(client, config, &change, &identity).await);
        }
        self.vouched.send_if_modified(|vouched| {
            let moved = previous > *vouched;
            *vouched = (*vouched).max(previous);
            moved
        });
        Ok(Checked::Vouched(*self.vouched.borrow()))
    }
}

/// What changed, for the refusal (TI3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The change, in words.
    pub what: String,
    /// Whether the publication no longer publishes the table's inserts, so that
    /// `ALTER PUBLICATION … ADD TABLE` (or another fix of the publication) is needed.
    pub fix_publication: bool,
    /// The same table and publication: only the publication's settings or coverage changed.
    pub publication_only: bool,
}

impl Change {
    /// The change from `streamed` to `now`, if any.
    pub fn between(streamed: &Identity, now: &Identity) -> Option<Change> {
        let mut what = Vec::new();
        match (streamed.table_oid, now.table_oid) {
            (Some(was), None) => what.push(format!(
                "no longer exists (the relay streamed OID {was}: dropped, or renamed away)"
            )),
            (Some(was), Some(is)) if was != is => what.push(format!(
                "is now OID {is}, the relay streamed OID {was} (dropped and created again, or swapped by rename{})",
                if now.partitioned && !streamed.partitioned {
                    ": now partitioned"
                } else {
                    ""
                }
            )),
            _ => {}
        }
        match (streamed.publication_oid, now.publication_oid) {
            (Some(_), None) => what.push("its publication no longer exists".to_owned()),
            (Some(was), Some(is)) if was != is => what.push(format!(
                "its publication was dropped and created again (OID {is}, was {was})"
            )),
            _ => {}
        }
        if now.publication_oid.is_some() && now.table_oid.is_some() {
            if !now.insert && streamed.insert {
                what.push("its publication no longer publishes inserts".to_owned());
            }
            let covered = now.all_tables || now.membership.is_some() || now.schema_listed;
            if !covered {
                what.push("its publication no longer covers it".to_owned());
            } else if streamed.membership.is_some()
                && now.membership.is_some()
                && streamed.membership != now.membership
                && streamed.table_oid == now.table_oid
            {
                what.push(
                    "it was removed from its publication and added again (inserts between the two were not decoded)"
                        .to_owned(),
                );
            }
            if now.partitioned && !now.via_root && streamed.via_root != now.via_root {
                what.push(
                    "its publication no longer publishes it with publish_via_partition_root"
                        .to_owned(),
                );
            }
        }
        if what.is_empty() {
            return None;
        }
        Some(Change {
            what: what.join("; "),
            fix_publication: !now.publishes(),
            publication_only: now.table_oid.is_some()
                && now.publication_oid.is_some()
                && streamed.table_oid == now.table_oid
                && streamed.publication_oid == now.publication_oid,
        })
    }
}

/// The permanent error for `change` to `now` (TI3).
fn refusal(config: &Config, change: &Change, now: &Identity, confirmed: Lsn) -> RelayError {
    let table = &config.table;
    let fix = if change.fix_publication {
        format!(
            "{}; then `outbox-relay verify` lists the rows missing from stream {}, those up to that id hidden by \
             the publication: publish them with `outbox-relay backfill --from-id <the first of them> --to-id <that id>` \
             (with --force on a strict stream), start the relay (it resumes from before the change) and run \
             `outbox-relay verify` again",
            publication_fix(config, now),
            config.stream
        )
    } else {
        "start the relay again (it resumes from before the change and relays what the publication published), then \
         run `outbox-relay verify`: rows it lists as missing were written before the publication covered the table; \
         publish them with `outbox-relay backfill --from-id <the first> --to-id <the last>` (with --force on a strict \
         stream)"
            .to_owned()
    };
    let confirmed = if confirmed > Lsn::ZERO {
        format!(
            "; slot {:?} is confirmed no further than {confirmed}, the last position an identity check vouched for",
            config.slot
        )
    } else {
        String::new()
    };
    RelayError::permanent(anyhow::anyhow!(
        "table {table} {}: {}, so the relay stops{confirmed}. To fix it, {fix}. To make the outbox table partitioned \
         without losing events, follow docs/operations.md (\"Converting the outbox table to a partitioned one\")",
        change.what,
        if change.fix_publication {
            format!("inserts into the table now named {table} are not decoded through publication {:?}", config.publication)
        } else {
            format!("the relay cannot vouch that every insert into the table now named {table} was decoded through publication {:?}", config.publication)
        },
    ))
}

/// What makes the publication publish the table's inserts again, as it is `now`: in one
/// transaction that holds inserts back and reads the last id the publication hid.
fn publication_fix(config: &Config, now: &Identity) -> String {
    let publication = replication::quote_identifier(&config.publication);
    let table = config.table.sql();
    let mut sql = Vec::new();
    let mut first = String::new();
    if now.publication_oid.is_none() {
        sql.push(format!(
            "CREATE PUBLICATION {publication} FOR TABLE {table} WITH (publish = 'insert', publish_via_partition_root = true);"
        ));
    } else {
        if now.table_oid.is_none() {
            first = format!("create {table} again or rename the new table into its place, then ");
        }
        if now.table_oid.is_none()
            || !(now.all_tables || now.membership.is_some() || now.schema_listed)
        {
            sql.push(format!(
                "ALTER PUBLICATION {publication} ADD TABLE {table};"
            ));
        }
        if !now.insert {
            sql.push(format!(
                "ALTER PUBLICATION {publication} SET (publish = 'insert'); (with the other actions it publishes)"
            ));
        }
        if now.partitioned && !now.via_root {
            sql.push(format!(
                "ALTER PUBLICATION {publication} SET (publish_via_partition_root = true);"
            ));
        }
    }
    format!(
        "{first}publish the table in one transaction that holds inserts back and reads the last id the publication \
         hid: BEGIN; LOCK TABLE {table} IN SHARE MODE; {} SELECT max(id) FROM {table}; COMMIT;",
        sql.join(" ")
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn streamed() -> Identity {
        Identity {
            table_oid: Some(16_400),
            partitioned: false,
            publication_oid: Some(16_500),
            insert: true,
            via_root: true,
            all_tables: false,
            membership: Some(16_501),
            schema_listed: false,
        }
    }

    /// [`streamed`] through a publication `FOR ALL TABLES`.
    fn all_tables() -> Identity {
        Identity {
            all_tables: true,
            membership: None,
            ..streamed()
        }
    }

    /// [`streamed`] after its table was dropped and created again.
    fn recreated() -> Identity {
        Identity {
            table_oid: Some(16_433),
            membership: None,
            ..streamed()
        }
    }

    /// `before` after a partitioned table was swapped in by rename.
    fn swapped_partitioned(before: &Identity) -> Identity {
        Identity {
            table_oid: Some(16_433),
            partitioned: true,
            ..before.clone()
        }
    }

    #[test]
    fn v3_an_unchanged_identity_is_no_change() {
        assert_eq!(Change::between(&streamed(), &streamed()), None);
        let all = all_tables();
        assert_eq!(Change::between(&all, &all), None);
    }

    #[test]
    fn v3_a_table_created_again_names_both_oids_and_the_publication_fix() {
        let now = recreated();
        let change = Change::between(&streamed(), &now).unwrap();
        assert!(
            change.what.contains(
                "is now OID 16433, the relay streamed OID 16400 (dropped and created again, or swapped by rename)"
            ),
            "{change:?}"
        );
        assert!(change.what.contains("no longer covers it"), "{change:?}");
        assert!(change.fix_publication);
    }

    #[test]
    fn v3_a_swap_into_a_partitioned_table_covered_by_all_tables_is_still_a_change() {
        let all = all_tables();
        let now = swapped_partitioned(&all);
        let change = Change::between(&all, &now).unwrap();
        assert!(change.what.contains("now partitioned"), "{change:?}");
        assert!(!change.fix_publication, "ALL TABLES covers it: {change:?}");
    }

    #[test]
    fn v3_publication_changes_are_named() {
        let changes = [
            (
                Identity {
                    table_oid: None,
                    ..streamed()
                },
                "no longer exists (the relay streamed OID 16400",
            ),
            (
                Identity {
                    membership: Some(16_999),
                    ..streamed()
                },
                "removed from its publication and added again",
            ),
            (
                Identity {
                    insert: false,
                    ..streamed()
                },
                "no longer publishes inserts",
            ),
            (
                Identity {
                    publication_oid: None,
                    membership: None,
                    ..streamed()
                },
                "publication no longer exists",
            ),
        ];
        for (now, named) in changes {
            let change = Change::between(&streamed(), &now).unwrap();
            assert!(change.what.contains(named), "{named}: {}", change.what);
        }
        let no_insert = Identity {
            insert: false,
            ..streamed()
        };
        assert!(
            Change::between(&streamed(), &no_insert)
                .unwrap()
                .fix_publication
        );
    }

    fn config() -> Config {
        crate::config::tests::load(
            &[],
            &[
                ("DATABASE_URL", "postgres://relay@db:5432/app"),
                ("OUTBOX_RELAY_PUBLICATION", "outbox_pub"),
            ],
            None,
        )
        .unwrap()
    }

    #[test]
    fn v3_the_refusal_names_the_change_the_confirmed_position_and_only_the_fix_needed() {
        let recreated = recreated();
        let change = Change::between(&streamed(), &recreated).unwrap();
        let text = refusal(&config(), &change, &recreated, Lsn(0x1_0000_0010)).to_string();
        for needle in [
            "table public.outbox_events is now OID 16433, the relay streamed OID 16400 (dropped and created again, or swapped by rename)",
            "is confirmed no further than 1/10",
            "ALTER PUBLICATION \"outbox_pub\" ADD TABLE \"public\".\"outbox_events\";",
            "`outbox-relay verify`",
            "`outbox-relay backfill --from-id <the first of them> --to-id <that id>`",
            "LOCK TABLE \"public\".\"outbox_events\" IN SHARE MODE;",
            "docs/operations.md",
        ] {
            assert!(text.contains(needle), "{needle:?} in {text}");
        }
        assert!(!text.contains("publish_via_partition_root"), "{text}");

        let all = all_tables();
        let swapped = swapped_partitioned(&all);
        let change = Change::between(&all, &swapped).unwrap();
        let text = refusal(&config(), &change, &swapped, Lsn::ZERO).to_string();
        assert!(!text.contains("ALTER PUBLICATION"), "covered: {text}");
        assert!(text.contains("cannot vouch"), "{text}");
        assert!(!text.contains("confirmed no further"), "{text}");
    }

    #[test]
    fn v2_the_check_reads_the_wal_position_in_a_statement_before_the_identity() {
        let config = crate::config::tests::load_url("postgres://relay@db:5432/app").unwrap();
        let sql = check_sql(&config, 150_000);
        let (first, second) = sql.split_once(';').unwrap();
        assert!(first.contains("pg_current_wal_lsn()"), "{sql}");
        assert!(!second.contains("pg_current_wal_lsn"), "{sql}");
        assert!(
            second.contains("to_regclass('\"public\".\"outbox_events\"')"),
            "{sql}"
        );
        assert!(second.contains("pg_publication_namespace"), "{sql}");
        assert!(!check_sql(&config, 140_000).contains("pg_publication_namespace"));
    }
}
