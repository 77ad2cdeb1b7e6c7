-- Publication and slot for outbox-relay. `outbox-relay run` (and `outbox-relay init`)
-- create both when missing; run this yourself when the relay's role may not (it must own
-- the table to create a publication), then start the relay with --no-create.
--
-- Requires wal_level = logical (ALTER SYSTEM SET wal_level = logical; then restart).
-- Only INSERTs are published: the relay publishes nothing for UPDATE, DELETE or TRUNCATE.
-- publish_via_partition_root (Postgres 13+) publishes the inserts into a partitioned
-- outbox table's partitions as inserts into the table, which is how the relay reads them;
-- it changes nothing for an unpartitioned table (drop it from the statement before 13).
-- The relay checks the publication at every start and refuses one that would hide an
-- insert from it (no inserts, a row filter, a column list without a column it reads,
-- partitions only, or no publish_via_partition_root for a partitioned table), naming the fix.

create publication outbox_relay for table public.outbox_events
  with (publish = 'insert', publish_via_partition_root = true);

-- Events committed before the slot exists are not streamed: when the relay creates the slot
-- itself it backfills them as --backfill says (pending by default); a slot created here gets
-- no backfill, so create it before the first event you want in the stream, or use
-- `outbox-relay backfill` (docs/migration.md on migrating from a polling publisher).
select pg_create_logical_replication_slot('outbox_relay', 'pgoutput');

-- Bound the WAL a stalled relay can make Postgres keep (Postgres 13+); past it the slot is
-- invalidated and the relay stops with an error instead of filling the disk.
-- alter system set max_slot_wal_keep_size = '10GB';
