-- A least-privilege role for outbox-relay: it may log in, open replication connections
-- and read the outbox table; nothing else. Run as a superuser (or a role with CREATEROLE),
-- after sql/schema.sql and sql/publication.sql.
--
-- Then allow replication connections in pg_hba.conf, e.g.
--   hostssl replication outbox_relay 10.0.0.0/8 scram-sha-256
--   hostssl app         outbox_relay 10.0.0.0/8 scram-sha-256
-- and run the relay with --no-create (it cannot create the publication: only the table's
-- owner can), e.g.
--   DATABASE_URL='postgres://outbox_relay:...@db/app?sslmode=verify-full&sslrootcert=ca.crt'

create role outbox_relay with login replication password 'change-me';
grant usage on schema public to outbox_relay;
grant select on table public.outbox_events to outbox_relay;
