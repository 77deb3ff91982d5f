#!/usr/bin/env bash
# A/B of two tollgate binaries on this machine, side by side (issue 16): a change too small
# for one run of benches/load.sh to resolve (identical cases there differ by up to 10%)
# is measured here in interleaved rounds.
#
#   bash benches/ab.sh OLD_BINARY NEW_BINARY        (ROUNDS=4 by default)
#   MODES="proxied 429 redis" bash benches/ab.sh OLD_BINARY NEW_BINARY
#
# Each binary serves one limit (default runtime, log level warn) in front of one nginx
# worker, once per mode: `proxied`, the memory store with a quota no run uses up; `429`, the
# memory store with a quota of 1, spent before the run (every request a 429 from the
# over-limit cache); `redis` (not by default), a quota no run uses up in one Redis shard
# (a `redis-server` of the script's own on a free port, stopped by PID; each binary under
# its own key prefix), CHARGEd after the response. Each round runs `wrk -t1 -c64 -d10s`
# against old and new in turn, mode by mode; the gateway's CPU comes from /proc/PID/stat
# (utime + stime of all its threads). Prints every round, then the means. Needs nginx, wrk
# and curl (and redis-server for `redis`).
set -euo pipefail
[[ $# == 2 && -x "$1" && -x "$2" ]] || { echo "usage: bash benches/ab.sh OLD_BINARY NEW_BINARY" >&2; exit 2; }
OLD=$1 NEW=$2 ROUNDS=${ROUNDS:-4} MODES=${MODES:-proxied 429}
for t in nginx wrk curl; do command -v $t >/dev/null || { echo "ab.sh: $t is missing" >&2; exit 2; }; done
D=$(mktemp -d)
HZ=$(getconf CLK_TCK)
declare -A PORT PID
cleanup() {
    for k in "${!PID[@]}"; do kill "${PID[$k]}" 2>/dev/null || true; done
    [[ -s $D/nginx.pid ]] && kill "$(cat "$D/nginx.pid")" 2>/dev/null || true
    [[ -n "${REDIS_PID:-}" ]] && kill "$REDIS_PID" 2>/dev/null || true
    rm -rf "$D"
}
trap cleanup EXIT
# shellcheck source=benches/upstream.sh
source "$(dirname "$0")/upstream.sh"
start_upstream "hello from upstream\n"
if [[ " $MODES " == *" redis "* ]]; then
    command -v redis-server >/dev/null || { echo "ab.sh: redis-server is missing (MODES has redis)" >&2; exit 2; }
    start_redis
fi
for bin in old new; do
    for mode in $MODES; do
        q=1000000000000
        [[ $mode == 429 ]] && q=1
        store='backend = "memory"'
        [[ $mode == redis ]] && store=$(printf 'backend = "redis"\nkey_prefix = "ab-%s:"\n[[store.shards]]\nprimary = "redis://127.0.0.1:%s"' "$bin" "$RP")
        p=$(free_port)
        cat >"$D/$bin-$mode.toml" <<TG
[server]
listen = "127.0.0.1:$p"
shutdown_grace = "1s"
watch_config = false
[log]
level = "warn"
[store]
$store
[[upstreams]]
name = "nginx"
targets = ["http://127.0.0.1:$UP"]
[[limits]]
name = "core"
window = "1h"
quota = { anonymous = $q }
[[routes]]
path_prefix = "/"
upstream = "nginx"
limits = ["core"]
TG
        b=$OLD
        [[ $bin == new ]] && b=$NEW
        "$b" --config "$D/$bin-$mode.toml" >"$D/$bin-$mode.log" 2>&1 &
        PID[$bin-$mode]=$!
        PORT[$bin-$mode]=$p
    done
done
for k in "${!PORT[@]}"; do
    for _ in $(seq 50); do curl -s -o /dev/null "http://127.0.0.1:${PORT[$k]}/" && break; sleep 0.1; done
    wrk -t1 -c64 -d2s "http://127.0.0.1:${PORT[$k]}/" >/dev/null   # warm-up (and the 429s' quota spent)
done
ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
printf 'round\tcase\treq/s\tgateway CPU us/req\n' | tee "$D/result.tsv"
for r in $(seq "$ROUNDS"); do
    for mode in $MODES; do
        for bin in old new; do
            k=$bin-$mode
            t0=$(ticks "${PID[$k]}")
            n=$(wrk -t1 -c64 -d10s "http://127.0.0.1:${PORT[$k]}/" | awk '/requests in/ { print $1 }')
            t1=$(ticks "${PID[$k]}")
            printf '%s\t%s\t%s\t%s\n' "$r" "$k" "$(( n / 10 ))" \
                "$(awk -v t=$(( t1 - t0 )) -v n="$n" -v hz="$HZ" 'BEGIN { printf "%.2f", t * 1e6 / hz / n }')"
        done
    done
done | tee -a "$D/result.tsv"
echo "means over $ROUNDS rounds:"
awk -F'\t' 'NR > 1 { r[$2] += $3; c[$2] += $4; n[$2]++ }
    END { for (k in r) printf "%-12s %8.0f req/s  %6.2f us/req\n", k, r[k] / n[k], c[k] / n[k] }' "$D/result.tsv" | sort
