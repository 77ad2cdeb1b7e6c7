-- The outbox table, exactly as the seed defines it (the deterministic, shard-aware outbox
-- design this project started from; README.md, "What it is").
--
-- outbox-relay reads id, entity_id, event_type, payload and created_at. It derives
-- dedupe_key, partition_key and ordering_key from the row itself and never trusts the
-- columns of those names (applications may fill them with placeholders); install
-- sql/trigger.sql if you want the table to hold exactly what the relay publishes.
-- status, attempts, last_error and published_at belong to polling publishers. The relay
-- reads status only when it creates its slot (--backfill pending: rows not yet 'published'
-- are backfilled), and writes status, attempts and published_at only with --mark-published
-- (docs/migration.md).

create table if not exists outbox_events (
  id bigserial primary key,

  -- business entity id; ordering is per entity
  entity_id text not null,

  -- logical event type, e.g. "OrderPaid"
  event_type text not null,

  -- stable, consumer-side idempotency key
  dedupe_key text not null unique,

  -- stable partition/routing key (string; broker will hash internally)
  partition_key text not null,

  -- stable ordering key (string; consumer can sort/compare)
  ordering_key text not null,

  payload jsonb not null,

  -- delivery state
  status text not null default 'pending', -- pending | published | failed
  attempts integer not null default 0,
  last_error text,

  created_at timestamptz not null default now(),
  published_at timestamptz
);

create index if not exists outbox_pending_idx
  on outbox_events(status, created_at);
