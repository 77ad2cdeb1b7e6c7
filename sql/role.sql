-- A least-privilege role for outbox-relay. Run it with psql as a superuser (Postgres 16+: or
-- a role with CREATEROLE and REPLICATION) connected to the outbox database, after
-- sql/schema.sql and sql/publication.sql:
--
--   psql -d app -f sql/role.sql                     # then: \password outbox_relay
--   psql -d app -v relay_password="$PW" -f sql/role.sql
--
-- No password is written here: give one in the psql variable relay_password (sent to the
-- server as written: use an encrypted connection, and keep it out of shell history), or set
-- it afterwards with psql's \password outbox_relay, which sends only its SCRAM hash.
--
-- What the role may do:
-- - log in, and CONNECT to this database (granted below: needed where CONNECT was revoked
--   from PUBLIC, which is advisable; then it reaches no other database);
-- - read the outbox table (SELECT), and nothing else of it;
-- - REPLICATION, which is more than "read the outbox": on a replication connection the role
--   may create and drop *any* replication slot of the cluster (dropping another consumer's
--   slot loses that consumer's place), and decode every table's changes in every database it
--   may connect to through a slot of the test_decoding plugin, whatever its table
--   privileges; with a pg_hba line matching the `replication` keyword it could also take a
--   physical copy of the whole cluster (pg_basebackup). Keep its pg_hba lines to what the
--   relay needs (below), and give the role to nothing but the relay.
--
-- pg_hba.conf: the relay's two connections (the replication stream, opened with
-- replication=database, and the control connection) both match a line by *database name*.
-- The `replication` keyword in the database column matches only physical replication
-- connections, which the relay never opens: do not add one for it. One line, e.g.
--
--   # TYPE   DATABASE  USER          ADDRESS      METHOD
--   hostssl  app       outbox_relay  10.0.0.0/8   scram-sha-256
--
-- (tests/secrets.rs proves both halves on a real server: the relay streams with only this
-- line, and is refused with only a `replication` line.) Then run the relay with a verified,
-- SCRAM-only connection (docs/operations.md, "Hardened connections"), e.g.
--   DATABASE_URL='postgres://outbox_relay@db/app?sslmode=verify-full&sslrootcert=/etc/ca.crt&require_auth=scram-sha-256'
-- with the password in PGPASSWORD or a password file, and --no-create unless the role may
-- create the slot (it may: REPLICATION) and NATS the stream; only the table's owner can
-- create the publication (sql/publication.sql).

create role outbox_relay with login replication;
\if :{?relay_password}
alter role outbox_relay with password :'relay_password';
\else
\echo 'outbox_relay has no password yet: set one with  \\password outbox_relay'
\endif
grant connect on database :"DBNAME" to outbox_relay;
grant usage on schema public to outbox_relay;
grant select on table public.outbox_events to outbox_relay;
