-- The consumer's side of the seed design (shared/seed/deterministic-shard-aware-outbox.md,
-- consumer.py): one row per event whose side effects committed, keyed by the seed's
-- dedupe_key = "{event_type}:{entity_id}:{id}".
--
-- Create it in the database your handlers write to: the consumer inserts the dedupe_key in
-- the SAME transaction as the handler's side effects, so both commit or neither does, and a
-- redelivered event whose key is already here is acknowledged without running the handler.
-- See docs/consumers.md. outbox-consumer (crates/consumer) checks at start that the table
-- exists; give each consuming application its own table (Config::processed_table) when
-- several share a database, or one would skip the other's events.
--
-- Rows may be deleted once no redelivery or replay of their event can arrive any more, that
-- is, once the event has left the stream (its max_age) and no consumer will be reset to
-- before it: for example `delete from processed_events where processed_at < now() - interval '30 days'`.

create table if not exists processed_events (
  dedupe_key text primary key,
  processed_at timestamptz not null default now()
);
