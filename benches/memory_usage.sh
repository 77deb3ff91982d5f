#!/usr/bin/env bash
# benches/memory_usage.sh: how many bytes of Redis one caller's state takes, per limit
# algorithm. The numbers are quoted in docs/algorithms.md.
#
# Usage (from anywhere inside the repo):
#   bash benches/memory_usage.sh
#   REDIS_SERVER=/opt/redis/bin/redis-server bash benches/memory_usage.sh
#
# Env knobs [default]:
#   REDIS_SERVER [redis-server on PATH]  the server binary to start
#   REDIS_CLI    [redis-cli next to REDIS_SERVER, else on PATH]
#   CALLERS      [10000]  callers per algorithm for the used_memory cross-check (0: skip it)
#
# What it does:
#   1. Starts its own redis-server on 127.0.0.1 and a free port, with no persistence
#      (--save "" --appendonly no), and kills it by PID on exit.
#   2. Loads lua/apply.lua (SCRIPT LOAD; behind one line that packs decimal arguments as
#      the script reads them) and applies operations with EVALSHA, using the ARGV layout
#      from the script's header: 9 integers per key (op, algorithm code,
#      quota, window ms, burst, align, cost, now ms, id), window 60000 ms, quota 100,
#      burst = quota, align 0 (first request), cost 1, now = the current epoch ms.
#        fixed_window, sliding_window, gcra: 1 and 100 charges (op 1) on one key.
#        sliding_log: 1, 10, 100 and 1000 charges (op 1), one sorted-set member each.
#        concurrency: 1, 10, 100 and 1000 slots taken (op 2, RESERVE).
#      Entries and slots get distinct ids 4503599627370000+i and times now+i ms. For
#      1000 entries or slots the quota is 1000 (so that 1000 slots can be held at once).
#   3. Prints `MEMORY USAGE key SAMPLES 0` (exact: every element counted) and
#      `OBJECT ENCODING key` per row, as a markdown table.
#   4. Cross-check: with CALLERS keys per algorithm (on an emptied database), each after
#      one operation at the same now, the growth of INFO's used_memory divided by CALLERS.
#      That includes what MEMORY USAGE leaves out: the key's entry in the expiry table and
#      the growth of Redis's hash tables. GCRA's charge there costs 100 units (the whole
#      burst), so that its key lives 61 s: after a 1-unit charge, the key expires
#      600 ms + 1 s later, possibly before the count. (The TAT takes the same room either
#      way: compare the single-key rows.)
#
# Keys look like the gateway's (store.key_prefix "tollgate:", limit "core"):
#   tollgate:core:{0123456789abcdef0123456789abcdef}              fixed_window
#   tollgate:core:ALGORITHM:{0123456789abcdef0123456789abcdef}    every other algorithm
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT="$ROOT/lua/apply.lua"
CALLERS="${CALLERS:-10000}"

die() {
  echo "memory_usage.sh: $*" >&2
  exit 1
}

SERVER="${REDIS_SERVER:-$(command -v redis-server || true)}"
[ -n "$SERVER" ] && [ -x "$SERVER" ] ||
  die "redis-server not found: install it (apt-get install redis-server) or set REDIS_SERVER=/path/to/redis-server"
CLI="${REDIS_CLI:-}"
if [ -z "$CLI" ]; then
  if [ -x "$(dirname "$SERVER")/redis-cli" ]; then
    CLI="$(dirname "$SERVER")/redis-cli"
  else
    CLI="$(command -v redis-cli || true)"
  fi
fi
[ -n "$CLI" ] && [ -x "$CLI" ] ||
  die "redis-cli not found: install it (apt-get install redis-tools) or set REDIS_CLI=/path/to/redis-cli"
[ -f "$SCRIPT" ] || die "$SCRIPT not found"

WORK="$(mktemp -d /tmp/tollgate-memory.XXXXXX)"
PID=""
cleanup() {
  if [ -n "$PID" ]; then
    kill "$PID" 2>/dev/null || true
    wait "$PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- start redis-server on a free loopback port ---------------------------------------

port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

candidates() {
  if command -v python3 >/dev/null 2>&1; then
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' || true
  fi
  seq 6400 6499
}

PORT=""
for p in $(candidates); do
  port_in_use "$p" && continue
  "$SERVER" --port "$p" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$WORK" --logfile "$WORK/redis.log" --daemonize no &
  PID=$!
  for _ in $(seq 50); do
    if "$CLI" -h 127.0.0.1 -p "$p" PING 2>/dev/null | grep -q PONG; then
      PORT="$p"
      break
    fi
    kill -0 "$PID" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$PORT" ] && break
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  PID=""
done
if [ -z "$PORT" ]; then
  tail -n 20 "$WORK/redis.log" >&2 2>/dev/null || true
  die "could not start $SERVER on a free loopback port (its log, above)"
fi

rc() {
  "$CLI" -h 127.0.0.1 -p "$PORT" "$@"
}

# lua/apply.lua reads its 10 integers per key packed in ARGV[1] (8 bytes each, as the gateway
# sends them); redis-cli sends text, so the script loaded here is apply.lua behind one line
# that packs the decimal arguments of each EVALSHA line first (struct.pack, exact below 2^53).
PACK='local p = {} for i = 1, #ARGV do p[i] = struct.pack("<I8", tonumber(ARGV[i])) ARGV[i] = nil end ARGV[1] = table.concat(p)'
SHA="$(rc SCRIPT LOAD "$PACK
$(cat "$SCRIPT")")"
[[ "$SHA" =~ ^[0-9a-f]{40}$ ]] || die "SCRIPT LOAD failed: $SHA"

# --- applying operations ------------------------------------------------------------

WINDOW=60000
BASE_ID=4503599627370000
DIGEST=0123456789abcdef0123456789abcdef

code_of() {
  case "$1" in
    fixed_window) echo 0 ;;
    sliding_window) echo 1 ;;
    sliding_log) echo 2 ;;
    gcra) echo 3 ;;
    concurrency) echo 4 ;;
  esac
}

key_of() { # algorithm digest
  if [ "$1" = fixed_window ]; then
    echo "tollgate:core:{$2}"
  else
    echo "tollgate:core:$1:{$2}"
  fi
}

# commands ALGORITHM KEYFMT QUOTA COST N NOW PER: the EVALSHA lines, for redis-cli's
# standard input, of N operations (charges; concurrency: slots taken) with ids
# BASE_ID+i at now+i ms (SAME_TIME=1: all at NOW), PER operations per call. KEYFMT is
# the key, with %032x standing for the operation's number when each operation has a key
# of its own (one call may also list the same key several times).
commands() {
  local alg="$1" keyfmt="$2" quota="$3" cost="$4" n="$5" now="$6" per="$7"
  local op=1
  [ "$alg" = concurrency ] && op=2
  awk -v sha="$SHA" -v code="$(code_of "$alg")" -v op="$op" -v quota="$quota" \
    -v window="$WINDOW" -v cost="$cost" -v n="$n" -v now="$now" -v per="$per" \
    -v keyfmt="$keyfmt" -v base="$BASE_ID" -v same="${SAME_TIME:-0}" 'BEGIN {
      for (i = 0; i < n; i += per) {
        m = (n - i < per) ? n - i : per
        keys = ""; args = ""
        for (j = i; j < i + m; j++) {
          keys = keys " " sprintf(keyfmt, j)
          t = same ? now : now + j
          # times and ids as %.0f: exact below 2^53, where %d may be 32-bit in some awks
          args = args sprintf(" %d %d %d %d %d 0 0 %d %.0f %.0f", op, code, quota, window, quota, cost, t, base + j)
        }
        print "EVALSHA " sha " " m keys args
      }
    }'
}

# apply ALGORITHM KEY QUOTA N NOW: N operations on KEY, 100 per EVALSHA. Every one must
# be admitted, or the state measured is not the one described.
apply() {
  local alg="$1" key="$2" quota="$3" n="$4" now="$5" out
  out="$(commands "$alg" "$key" "$quota" 1 "$n" "$now" 100 | rc)"
  # 3 integers per operation: used (admitted; -(used + 1) when refused), reset_at ms, and
  # the epoch (admitted) or retry_at ms (refused).
  if grep -q ERR <<<"$out" || [ "$(wc -l <<<"$out")" -ne $((3 * n)) ] ||
    [ "$(awk 'NR % 3 == 1 && $1 < 0' <<<"$out" | wc -l)" -ne 0 ]; then
    die "applying $n operations for $alg (quota $quota) failed: $(head -c 500 <<<"$out")"
  fi
}

# --- one key per row: MEMORY USAGE ----------------------------------------------------

rows() {
  for n in 1 100; do echo "fixed_window $n"; done
  for n in 1 100; do echo "sliding_window $n"; done
  for n in 1 10 100 1000; do echo "sliding_log $n"; done
  for n in 1 100; do echo "gcra $n"; done
  for n in 1 10 100 1000; do echo "concurrency $n"; done
}

type_of() {
  case "$1" in
    sliding_log | concurrency) echo "sorted set" ;;
    *) echo "hash" ;;
  esac
}

what_of() { # algorithm n
  case "$1" in
    sliding_log) noun=entry ;;
    concurrency) noun=slot ;;
    *) noun=charge ;;
  esac
  case "$noun:$2" in
    *:1) echo "1 $noun" ;;
    entry:*) echo "$2 entries" ;;
    *) echo "$2 ${noun}s" ;;
  esac
}

version="$(rc INFO server | tr -d '\r' | sed -n 's/^redis_version://p')"
echo "redis-server $version on 127.0.0.1:$PORT; window $WINDOW ms, cost 1, ids $BASE_ID+i"
echo
echo "| algorithm | key type | state | quota | encoding | MEMORY USAGE (bytes) |"
echo "| --- | --- | --- | --- | --- | --- |"
while read -r alg n; do
  rc FLUSHALL >/dev/null
  key="$(key_of "$alg" "$DIGEST")"
  quota=100
  [ "$n" -gt 100 ] && quota="$n"
  now="$(date +%s%3N)"
  apply "$alg" "$key" "$quota" "$n" "$now"
  bytes="$(rc MEMORY USAGE "$key" SAMPLES 0)"
  enc="$(rc OBJECT ENCODING "$key")"
  echo "| $alg | $(type_of "$alg") | $(what_of "$alg" "$n") | $quota | $enc | $bytes |"
done < <(rows)

echo
echo "Encoding thresholds of this server (a hash or sorted set with more elements, or a longer"
echo "element, moves from listpack to a hash table / skiplist, which takes more per element):"
for p in hash-max-listpack-entries hash-max-listpack-value zset-max-listpack-entries zset-max-listpack-value; do
  echo "  $p $(rc CONFIG GET "$p" | tail -n 1)"
done

# --- cross-check: used_memory over many callers -------------------------------------

if [ "$CALLERS" -gt 0 ]; then
  used_memory() {
    rc INFO memory | tr -d '\r' | sed -n 's/^used_memory://p'
  }
  echo
  echo "Cross-check: used_memory growth per caller, $CALLERS callers with one charge (concurrency:"
  echo "one slot; gcra: one charge of 100 units) each"
  echo
  echo "| algorithm | bytes per caller |"
  echo "| --- | --- |"
  for alg in fixed_window sliding_window sliding_log gcra concurrency; do
    rc FLUSHALL >/dev/null
    cost=1
    [ "$alg" = gcra ] && cost=100
    before="$(used_memory)"
    now="$(date +%s%3N)"
    SAME_TIME=1 commands "$alg" "$(key_of "$alg" '%032x')" 100 "$cost" "$CALLERS" "$now" 100 |
      rc >"$WORK/out" || die "EVALSHA failed for $alg"
    ! grep -q ERR "$WORK/out" || die "EVALSHA failed for $alg: $(grep -m1 ERR "$WORK/out")"
    [ "$(rc DBSIZE)" -eq "$CALLERS" ] || die "expected $CALLERS keys for $alg, found $(rc DBSIZE)"
    after="$(used_memory)"
    echo "| $alg | $(((after - before) / CALLERS)) |"
  done
fi
