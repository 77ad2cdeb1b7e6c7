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

-- Events whose handler kept failing (Config::max_attempts, Config::on_failure = park, the
-- default), and the later events of their entities, parked behind them unhandled so that
-- the entity's order holds. Each row is written in the transaction that records its
-- dedupe_key above, then the message is acknowledged: the shard goes on, and the event is
-- kept here (its headers and payload too, so the stream's retention does not matter).
-- attempts = 0: not handled, parked because an earlier event of its entity is parked.
--
-- See:       select stream_sequence, outbox_id, entity_id, attempts, error, parked_at
--            from parked_events where consumer = 'ledger' order by stream_sequence;
-- Re-drive:  update parked_events set redrive = true
--            where consumer = 'ledger' and entity_id = 'order-42';
--            (the consumer handles the entity's parked events again within 5 s, in stream
--            order, each in a transaction that deletes its row; one that fails again stays,
--            with attempts + 1, its error and redrive = false, and so do the later ones)
-- Discard:   delete from parked_events where consumer = 'ledger' and entity_id = 'order-42';
--            (its events stay recorded as processed; the entity's next events are handled)
-- docs/consumers.md has the details.

create table if not exists parked_events (
  consumer text not null,          -- Config::name
  dedupe_key text not null,
  outbox_id bigint,                -- an integer id (the seed's table); else null
  outbox_id_text text,             -- a uuid or text id; else null (exactly one of the two is set)
  entity_id text not null,
  event_type text not null,
  shard bigint not null,
  stream_sequence bigint not null,
  delivered bigint not null,       -- JetStream's delivery count when it was parked
  attempts integer not null,       -- handler failures; 0: parked behind an earlier event
  error text not null,
  subject text not null,
  headers jsonb not null,          -- [[name, value], ...] as published
  payload bytea not null,
  parked_at timestamptz not null default now(),
  redrive boolean not null default false,
  primary key (consumer, dedupe_key)
);

-- Tables made before uuid and text ids (issue 22): the same columns, idempotently. Run this
-- file again before starting an outbox-consumer that reads a relay publishing uuid or text
-- ids; an older consumer keeps working on the altered table.
alter table parked_events add column if not exists outbox_id_text text;
alter table parked_events alter column outbox_id drop not null;

create index if not exists parked_events_by_shard
  on parked_events (consumer, shard, entity_id, stream_sequence);
