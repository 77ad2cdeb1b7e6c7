-- Optional: make the table's key columns hold exactly what outbox-relay derives and
-- publishes, so table and wire agree (and the seed's placeholders disappear).
--
--   dedupe_key    = event_type || ':' || entity_id || ':' || id
--   partition_key = entity_id
--   ordering_key  = created_at in epoch milliseconds, zero-padded to 13 characters
--                   (sign-aware, as Python's {:013d}), ':', id zero-padded to 20
--
-- Milliseconds are the exact floor of the microsecond timestamp: extract(epoch ...) is
-- numeric (exact) on Postgres 14+, and floor() rounds toward minus infinity.
-- The shard is not a column; it is sha256(entity_id)'s first 8 bytes mod the partition count.

create or replace function outbox_relay_pad(value numeric, width int) returns text
language sql immutable strict as $$
  select case
    when value < 0 then '-' || lpad((-value)::text, greatest(width - 1, length((-value)::text)), '0')
    else lpad(value::text, greatest(width, length(value::text)), '0')
  end
$$;

create or replace function outbox_relay_fill_keys() returns trigger
language plpgsql as $$
begin
  new.dedupe_key := new.event_type || ':' || new.entity_id || ':' || new.id;
  new.partition_key := new.entity_id;
  new.ordering_key := outbox_relay_pad(floor(extract(epoch from new.created_at) * 1000), 13)
                      || ':' || outbox_relay_pad(new.id, 20);
  return new;
end
$$;

drop trigger if exists outbox_relay_fill_keys on outbox_events;
create trigger outbox_relay_fill_keys
  before insert on outbox_events
  for each row execute function outbox_relay_fill_keys();
