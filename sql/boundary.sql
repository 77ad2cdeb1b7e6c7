-- Where outbox-relay records its slot's boundary: which rows already in the table when it
-- created the slot were left out of the stream by design (with --backfill pending, those
-- the polling publisher had already published), so that `outbox-relay verify` expects exactly
-- the rows on the relay's side (crates/relay/src/boundary.rs, docs/migration.md).
--
-- The relay creates this table itself when its role may create tables in the outbox table's
-- schema. Otherwise create it there, in the same schema as the outbox table, before the relay
-- creates its slot, and let the relay's role write it; without it the relay warns and
-- verify reports the left-out rows as missing.

create table if not exists outbox_relay_boundary (
  slot text primary key,             -- the replication slot
  outbox_table text not null,        -- the outbox table, schema-qualified
  mode text not null,                -- the backfill mode: pending or all
  consistent_point pg_lsn not null,  -- the slot streams what commits from here on
  snapshot_max_id int8,              -- the highest id in the slot's snapshot
  snapshot_rows int8 not null,       -- rows in the slot's snapshot
  left_out_rows int8 not null,       -- rows left out by design
  left_out int8[] not null,          -- the left-out ids as runs: {lo1, hi1, lo2, hi2, ...}
  recorded_at timestamptz not null default now()
);

grant select, insert, update on table outbox_relay_boundary to outbox_relay;
