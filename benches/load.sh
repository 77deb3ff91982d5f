#!/usr/bin/env bash
# benches/load.sh — throughput and latency overhead of the tollgate gateway.
#
# What it measures (wrk -t2 -c64 --latency, everything on 127.0.0.1):
#   upstream direct          the bare upstream (examples/upstream.rs): the baseline
#   gateway, memory          tollgate in front of it, [store] backend = "memory"
#   gateway, redis           the same with backend = "redis" (one local redis-server shard)
#   redis, rejected          quota = 1, so nearly every request is a 429 (the rejection path;
#                            with the default in-process over-limit cache)
#   redis, rejected, no cache  the same with store.local_cache_size = 0, so every
#                            rejection is a Redis round trip
# For each: requests/s, p50 and p99 latency, non-2xx responses, socket errors, and the
# gateway's peak RSS (VmHWM, read just before it is stopped).
#
# The limit's quota is 1e9 in the accepted scenarios, so nothing is rejected there.
# on_error = "deny": should Redis fail or time out, the gateway answers 503 and the
# failure shows up in the non-2xx column instead of silently skipping the store.
#
# Run:   bash benches/load.sh                 (10 s per scenario)
#        DURATION=30s bash benches/load.sh    (wrk's -d syntax: 30s, 2m, ...)
# Needs: cargo, redis-server; installs wrk with apt-get if it is missing (as root).
# The load generator, upstream, gateway and Redis share this machine's cores, so compare
# the rows with each other; absolute numbers depend heavily on the host.

set -euo pipefail

DURATION="${DURATION:-10s}"
THREADS=2
CONNECTIONS=64

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="$(mktemp -d -t tollgate-load.XXXXXX)"
PIDS=()

log() { printf '%s\n' "$*" >&2; }
die() { log "load.sh: $*"; exit 1; }

# Stop one process we started: SIGTERM, then SIGKILL if it is still there after 5 s.
stop_pid() {
    local pid="$1" i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---- tools -----------------------------------------------------------------------------

ensure_pkg() { # ensure_pkg COMMAND PACKAGE
    command -v "$1" >/dev/null && return 0
    log "installing $2 (apt-get)"
    apt-get install -y "$2" >/dev/null || { apt-get update >/dev/null && apt-get install -y "$2" >/dev/null; }
    command -v "$1" >/dev/null || die "$1 still missing after installing $2"
}
ensure_pkg wrk wrk
ensure_pkg redis-server redis-server

log "building release binaries"
cargo build --release --quiet --bin tollgate --example upstream
GATEWAY="$ROOT/target/release/tollgate"
UPSTREAM="$ROOT/target/release/examples/upstream"

# wrk's -d value in seconds, to bound each run with `timeout`.
duration_secs() {
    local d="$1"
    case "$d" in
        *s) echo "${d%s}" ;;
        *m) echo $(( ${d%m} * 60 )) ;;
        *h) echo $(( ${d%h} * 3600 )) ;;
        *) echo "$d" ;;
    esac
}
DURATION_SECS="$(duration_secs "$DURATION")"
[[ "$DURATION_SECS" =~ ^[0-9]+$ ]] || die "DURATION must look like 10s, 2m or 1h (got '$DURATION')"

# ---- ports and processes ---------------------------------------------------------------

TAKEN=" "
# free_port VAR: set VAR to a port in 20000-59999 that nothing on 127.0.0.1 listens on
# and that we have not handed out before. (Not `$(free_port)`: TAKEN must persist.)
free_port() {
    local candidate i
    for i in $(seq 200); do
        candidate=$(( 20000 + RANDOM % 40000 ))
        [[ "$TAKEN" == *" $candidate "* ]] && continue
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$candidate") 2>/dev/null; then
            TAKEN+="$candidate "
            printf -v "$1" '%s' "$candidate"
            return 0
        fi
    done
    die "no free port found"
}

# wait_port PID PORT NAME LOGFILE: until PORT accepts connections (10 s at most).
wait_port() {
    local pid="$1" port="$2" name="$3" logfile="$4" i
    for i in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || { cat "$logfile" >&2 || true; die "$name exited during start-up"; }
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    cat "$logfile" >&2 || true
    die "$name did not listen on 127.0.0.1:$port within 10 s"
}

# Status code of one GET to the URL (sanity check before each run).
probe() { curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$1" || echo "000"; }

peak_rss() { # VmHWM of PID, in MiB
    awk '/^VmHWM:/ { printf "%.1f MiB", $2 / 1024 }' "/proc/$1/status"
}

# ---- config ----------------------------------------------------------------------------

# write_config FILE PORT BACKEND QUOTA [EXTRA_STORE_LINES]
write_config() {
    local file="$1" port="$2" backend="$3" quota="$4" extra="${5:-}"
    {
        cat <<EOF
# Generated by benches/load.sh.
[server]
listen = "127.0.0.1:$port"
shutdown_grace = "1s"

[log]
level = "warn"

[store]
backend = "$backend"
on_error = "deny"
key_prefix = "bench-$port:"
$extra
EOF
        if [[ "$backend" == redis ]]; then
            cat <<EOF

[[store.shards]]
primary = "redis://127.0.0.1:$REDIS_PORT"
EOF
        fi
        cat <<EOF

[[upstreams]]
name = "bench"
targets = ["http://127.0.0.1:$UPSTREAM_PORT"]

[[limits]]
name = "core"
window = "1h"
quota = { anonymous = $quota }

[[routes]]
path_prefix = "/"
upstream = "bench"
limits = ["core"]
EOF
    } >"$file"
    "$GATEWAY" check --config "$file" >&2 || die "generated config $file is invalid"
}

# ---- measuring -------------------------------------------------------------------------

ROWS=()

# run_wrk NAME URL RSS: run wrk, keep its output, add a table row.
run_wrk() {
    local name="$1" url="$2" rss="$3" out="$WORK/wrk-${#ROWS[@]}.txt"
    log "wrk: $name ($DURATION)"
    timeout --kill-after=5 $(( DURATION_SECS + 60 )) \
        wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" --latency "$url" >"$out" \
        || { cat "$out" >&2; die "wrk failed for $name"; }
    local rps p50 p99 non2xx errors
    rps=$(awk '/^Requests\/sec:/ { printf "%.0f", $2 }' "$out")
    p50=$(awk '$1 == "50%" { print $2 }' "$out")
    p99=$(awk '$1 == "99%" { print $2 }' "$out")
    non2xx=$(awk '/Non-2xx or 3xx responses:/ { print $NF }' "$out")
    errors=$(awk '/Socket errors:/ { gsub(",", ""); print $4 + $6 + $8 + $10 }' "$out")
    ROWS+=("$(printf '%-26s %10s %10s %10s %10s %7s %12s' \
        "$name" "$rps" "$p50" "$p99" "${non2xx:-0}" "${errors:-0}" "$rss")")
}

# gateway_scenario NAME CONFIG EXPECTED_STATUS
gateway_scenario() {
    local name="$1" config="$2" expect="$3" port pid status rss
    port=$(awk -F'[:"]' '/^listen =/ { print $(NF-1); exit }' "$config")
    "$GATEWAY" --config "$config" >"$WORK/gateway-$port.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    wait_port "$pid" "$port" "tollgate ($name)" "$WORK/gateway-$port.log"
    status=$(probe "http://127.0.0.1:$port/")
    if [[ "$expect" == 429 ]]; then status=$(probe "http://127.0.0.1:$port/"); fi
    [[ "$status" == "$expect" ]] || {
        cat "$WORK/gateway-$port.log" >&2
        die "$name: expected HTTP $expect from the gateway, got $status"
    }
    # Measure the gateway's memory without counting wrk: read VmHWM after the run.
    run_wrk "$name" "http://127.0.0.1:$port/" "PENDING"
    rss=$(peak_rss "$pid")
    ROWS[-1]="${ROWS[-1]/PENDING/$rss}"
    stop_pid "$pid"
}

# ---- the scenarios ---------------------------------------------------------------------

port=""
free_port UPSTREAM_PORT
"$UPSTREAM" "127.0.0.1:$UPSTREAM_PORT" >"$WORK/upstream.log" 2>&1 &
PIDS+=("$!")
wait_port "$!" "$UPSTREAM_PORT" upstream "$WORK/upstream.log"

free_port REDIS_PORT
redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
    --dir "$WORK" --daemonize no >"$WORK/redis.log" 2>&1 &
PIDS+=("$!")
wait_port "$!" "$REDIS_PORT" redis-server "$WORK/redis.log"

[[ "$(probe "http://127.0.0.1:$UPSTREAM_PORT/")" == 200 ]] || die "upstream does not answer 200"
run_wrk "upstream direct" "http://127.0.0.1:$UPSTREAM_PORT/" "-"

free_port port
write_config "$WORK/memory.toml" "$port" memory 1000000000
gateway_scenario "gateway, memory" "$WORK/memory.toml" 200

free_port port
write_config "$WORK/redis.toml" "$port" redis 1000000000
gateway_scenario "gateway, redis" "$WORK/redis.toml" 200

free_port port
write_config "$WORK/rejected.toml" "$port" redis 1
gateway_scenario "redis, rejected" "$WORK/rejected.toml" 429

free_port port
write_config "$WORK/rejected-nocache.toml" "$port" redis 1 "local_cache_size = 0"
gateway_scenario "redis, rejected, no cache" "$WORK/rejected-nocache.toml" 429

# ---- report ----------------------------------------------------------------------------

rev="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD 2>/dev/null || rev+="+dirty"
echo "tollgate $rev | wrk -t$THREADS -c$CONNECTIONS -d$DURATION | $(nproc) cores | $(uname -sr)"
printf '%-26s %10s %10s %10s %10s %7s %12s\n' \
    scenario "req/s" p50 p99 non-2xx errors "gateway RSS"
printf '%s\n' "${ROWS[@]}"
exit 0
