#!/usr/bin/env bash
# The walsender's CPU per event under pgoutput's options (issue 23: what the relay could ask
# of the walsender, the third process of the pipeline).
#
# Usage: walsender_cost.sh [PG_BIN_DIR=/usr/lib/postgresql/15/bin] [N=200000] [ROUNDS=3]
#
# Starts its own PostgreSQL (initdb in a temporary directory, as the postgres user when run as
# root, wal_level=logical), creates sql/schema.sql's outbox_events, two publications (the
# whole table; a column list of what the relay reads by default: id, entity_id, event_type,
# payload, created_at) and one slot per mode and round, writes N rows in 1 000-row
# transactions, then decodes that WAL through each slot with pg_recvlogical (proto_version 1,
# to the WAL position after the last insert, output to /dev/null) and prints the walsender's
# CPU per event: the postmaster's reaped children's utime + stime (/proc/PID/stat) across the
# run, which is the walsender's once pg_recvlogical's connection ends.
# - text:   pgoutput's default, every column as text (what the relay asks for);
# - binary: binary=true (each column in its type's send format);
# - cols:   the column-list publication (PostgreSQL 15+), text.
# A measurement tool, not a test: it checks nothing but that each decode reached the end.
set -euo pipefail
BIN=${1:-/usr/lib/postgresql/15/bin}
N=${2:-200000}
ROUNDS=${3:-3}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
DIR=$(mktemp -d)
trap 'as_pg "$BIN/pg_ctl -D $DIR/data stop -m immediate" >/dev/null 2>&1 || true; rm -rf "$DIR"' EXIT
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -c "$1"; else sh -c "$1"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$DIR"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
as_pg "$BIN/initdb -D $DIR/data -A trust -U postgres >/dev/null"
as_pg "$BIN/pg_ctl -D $DIR/data -l $DIR/log -w start -o '-p $PORT -k $DIR -c listen_addresses= -c wal_level=logical -c max_wal_senders=20 -c max_replication_slots=40'" >/dev/null
P="$BIN/psql -h $DIR -p $PORT -U postgres -d postgres -qAtX -v ON_ERROR_STOP=1"
$P -f "$ROOT/sql/schema.sql" >/dev/null
$P -c "create publication p_all for table outbox_events with (publish = 'insert')"
$P -c "create publication p_cols for table outbox_events (id, entity_id, event_type, payload, created_at) with (publish = 'insert')"
MODES="text binary cols"
for round in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    $P -c "select pg_create_logical_replication_slot('s_${mode}_$round', 'pgoutput')" >/dev/null
  done
done
for ((k = 0; k < N; k += 1000)); do
  echo "insert into outbox_events (entity_id, event_type, dedupe_key, partition_key, ordering_key, payload)
        select 'entity-' || (k % 1000), 'OrderPaid', 'd' || k, 'entity-' || (k % 1000), 'tmp',
               jsonb_build_object('order_id', k, 'amount', 10)
          from generate_series($k, $k + 999) k;"
done | $P >/dev/null
END=$($P -c "select pg_current_wal_flush_lsn()")
POSTMASTER=$(head -1 "$DIR/data/postmaster.pid")
TICK=$(getconf CLK_TCK)
children() { awk '{print $16 + $17}' "/proc/$POSTMASTER/stat"; }
echo "PostgreSQL $($BIN/postgres --version | awk '{print $3}'), $N events in 1 000-row transactions, $ROUNDS rounds"
for round in $(seq 1 "$ROUNDS"); do
  for mode in $MODES; do
    case $mode in
      text) options=(-o publication_names=p_all) ;;
      binary) options=(-o publication_names=p_all -o binary=true) ;;
      cols) options=(-o publication_names=p_cols) ;;
    esac
    before=$(children)
    "$BIN/pg_recvlogical" -h "$DIR" -p "$PORT" -U postgres -d postgres -S "s_${mode}_$round" \
      --start -E "$END" -f /dev/null -o proto_version=1 "${options[@]}"
    # The postmaster reaps the walsender just after the connection ends.
    for _ in $(seq 1 50); do
      [ "$($P -c "select count(*) from pg_stat_replication")" = 0 ] && break
      sleep 0.1
    done
    sleep 0.2
    after=$(children)
    python3 -c "print(f'round $round $mode: walsender {($after - $before) / $TICK * 1e6 / $N:.2f} µs/event')"
  done
done
