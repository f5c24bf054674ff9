#!/usr/bin/env bash
# Start a PostgreSQL 15 server on 127.0.0.1:${PGPORT:-5432} (user postgres, trust auth) unless one
# already answers there. Idempotent: installs the server with apt-get only when its binaries are
# missing, initialises the data directory only once, starts the server only when it is not up.
# As root, initdb/postgres refuse to run: they run as the postgres user (runuser).
set -euo pipefail
PGPORT="${PGPORT:-5432}"
PGDATA_DIR="${RACER_CI_PGDATA:-/var/tmp/racer-ci-pgdata}"

bindir() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1; }

if [ -z "$(bindir)" ] || [ ! -x "$(bindir)/pg_ctl" ]; then
    echo "ci: installing postgresql"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q postgresql >/dev/null
fi
BIN="$(bindir)"
export PATH="$BIN:$PATH"

if "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PGPORT"; then
    echo "ci: postgresql already up on 127.0.0.1:$PGPORT"
    exit 0
fi

as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

if [ ! -f "$PGDATA_DIR/PG_VERSION" ]; then
    mkdir -p "$PGDATA_DIR"
    [ "$(id -u)" = 0 ] && chown postgres "$PGDATA_DIR"
    chmod 700 "$PGDATA_DIR"
    as_pg "$BIN/initdb" -D "$PGDATA_DIR" -U postgres --auth=trust >/dev/null
fi
as_pg "$BIN/pg_ctl" -D "$PGDATA_DIR" -l "$PGDATA_DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PGPORT -k /tmp" start >/dev/null
"$BIN/pg_isready" -h 127.0.0.1 -p "$PGPORT"
echo "ci: postgresql started on 127.0.0.1:$PGPORT (data $PGDATA_DIR)"
