#!/usr/bin/env bash
# A PostgreSQL server of its own for a sweep's Optuna storage (sweep.storage), as a user would start one:
#   bash scripts/postgres_server.sh start DIR [PORT]   # prints the storage URL (also written to DIR/url)
#   bash scripts/postgres_server.sh stop DIR
# Debian's server (`postgresql` package; installed with apt-get when missing, which needs root or sudo), a
# cluster in DIR/data, listening on 127.0.0.1:PORT only (default 5432), a database and a user `prunelight` with a
# random password. PostgreSQL refuses to run as root: started by root, the server runs as the OS user `postgres`
# (made by the package), which then owns DIR. Logs: DIR/server.log. Every failure is one line on stderr, status 1.
set -euo pipefail
CMD=${1:-}; DIR=${2:-}; PORT=${3:-5432}
DB=prunelight
die() { echo "postgres_server.sh: $*" >&2; exit 1; }
[[ "$CMD" == start || "$CMD" == stop ]] && [[ -n "$DIR" ]] || die "usage: $0 start|stop DIR [PORT]"
[[ "$PORT" =~ ^[0-9]+$ ]] || die "PORT=$PORT is not allowed: a TCP port number"

bin_dir() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

install_server() {
  local sudo=()
  if [[ $(id -u) != 0 ]]; then
    sudo -n true 2>/dev/null \
      || die "PostgreSQL is not installed and installing it needs root: apt-get install postgresql"
    sudo=(sudo -n)
  fi
  command -v apt-get >/dev/null || die "PostgreSQL is not installed and this system has no apt-get: install its server"
  # the package may start a cluster of its own ('main', port 5432): ours below is separate from it
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
    && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null \
    || die "apt-get install postgresql failed"
}

# Run a server program as the OS user that owns the cluster: `postgres` when we are root, else ourselves.
as_owner() {
  if [[ $(id -u) == 0 ]]; then
    id postgres >/dev/null 2>&1 || die "running as root needs the OS user 'postgres' (made by the postgresql package)"
    # from DIR, which it owns: its programs would otherwise complain that they cannot enter our working folder
    (cd "$DIR" && runuser -u postgres -- "$@")
  else
    "$@"
  fi
}

BIN=$(bin_dir)
if [[ "$CMD" == stop ]]; then
  [[ -n "$BIN" && -f "$DIR/data/PG_VERSION" ]] || exit 0  # nothing was started there
  as_owner "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  exit 0
fi

[[ -n "$BIN" ]] || install_server
BIN=$(bin_dir)
[[ -x "$BIN/initdb" ]] || die "no PostgreSQL server programs under /usr/lib/postgresql/*/bin"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
if [[ $(id -u) == 0 ]]; then
  chown postgres: "$DIR"
  runuser -u postgres -- test -w "$DIR" \
    || die "DIR=$DIR is not reachable by the OS user 'postgres' (a parent folder is private): use a folder under /tmp"
fi
if [[ ! -f "$DIR/data/PG_VERSION" ]]; then
  as_owner "$BIN/initdb" -D "$DIR/data" -U postgres -E UTF8 --auth-local=trust --auth-host=scram-sha-256 \
    >"$DIR/initdb.log" 2>&1 || die "initdb failed: see $DIR/initdb.log"
fi
if ! as_owner "$BIN/pg_ctl" -D "$DIR/data" status >/dev/null 2>&1; then
  # TCP on 127.0.0.1 only; the socket (for the setup below) in DIR, not in the system's /var/run/postgresql
  as_owner "$BIN/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR" start >/dev/null \
    || die "the server did not start on 127.0.0.1:$PORT: see $DIR/server.log"
fi
if [[ ! -f "$DIR/password" ]]; then
  PASSWORD=$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')
  sql() { as_owner "$BIN/psql" -h "$DIR" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtA -c "$1"; }
  sql "CREATE ROLE $DB LOGIN PASSWORD '$PASSWORD'" >/dev/null || die "could not create the user $DB"
  sql "CREATE DATABASE $DB OWNER $DB" >/dev/null || die "could not create the database $DB"
  (umask 077 && echo "$PASSWORD" >"$DIR/password")
fi
# +psycopg: SQLAlchemy 2.0 would pick psycopg2 for a bare postgresql:// (2.1 picks psycopg)
echo "postgresql+psycopg://$DB:$(cat "$DIR/password")@127.0.0.1:$PORT/$DB" | tee "$DIR/url"
