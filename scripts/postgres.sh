#!/usr/bin/env bash
# A throwaway PostgreSQL server for kvreplay's store tests (.ci/run starts one).
#   eval "$(bash scripts/postgres.sh start DIR)"   # prints: export KVREPLAY_TEST_PG=...
#   bash scripts/postgres.sh stop DIR
# The data directory and the Unix socket live in DIR; the server listens on no TCP
# port. PostgreSQL refuses to run as root: as root it runs as the postgres user.
set -euo pipefail
cmd=${1:?start or stop}; dir=${2:?data directory}
bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$bin" ] || bin=$(dirname "$(command -v initdb)")
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
case $cmd in
start)
  mkdir -p "$dir"
  if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    as_pg "$bin/initdb" -D "$dir/data" -U postgres -A trust --no-sync >"$dir/initdb.log" 2>&1
  fi
  as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-k $dir -c listen_addresses='' -c fsync=off -c max_connections=100" start >/dev/null
  echo "export KVREPLAY_TEST_PG='postgresql+psycopg://postgres@/postgres?host=$dir'"
  ;;
stop)
  as_pg "$bin/pg_ctl" -D "$dir/data" -m fast stop >/dev/null 2>&1 || true
  ;;
*) echo "usage: $0 start|stop DIR" >&2; exit 2 ;;
esac
