#!/usr/bin/env bash
# A profile-guided release build of tollgate (issue 16): the same code as
# `cargo build --release`, laid out and inlined by the compiler according to where a
# gateway under load spends its time.
#
#   bash benches/pgo.sh                 writes target/pgo/tollgate
#   bash benches/pgo.sh floor           writes benches/floor/target/pgo/tollgate-floor: the hyper
#                                       floor built the same way, trained on plain proxying and
#                                       FLOOR_CONTRACT=1 (benches/load.sh's hyper_floor_pgo)
#
# 1. builds an instrumented binary (`-Cprofile-generate`) in target/pgo-gen;
# 2. runs it through representative traffic, `wrk -t1 -c64` for TRAIN_SECS (default 5)
#    seconds per case, in front of one nginx worker answering `ok`, every case with the
#    default runtime (one worker per core):
#      - the memory store, one limit, callers by IP (the proxied request);
#      - the memory store, API keys (`Authorization: Bearer`), two limits on a longer
#        route (`/search`), POST bodies;
#      - 429s: a quota of 5, spent, so that the over-limit cache answers;
#      - a Redis shard (a redis-server of its own on a free port), one limit;
# 3. merges the counts with `llvm-profdata` of rustc's own LLVM version and builds again
#    with `-Cprofile-use` in target/pgo-use; copies the binary to target/pgo/tollgate.
#
# Both builds take the release profile (fat LTO, one codegen unit), so expect about twice
# a release build's time. `RUSTFLAGS` is passed with `--target` (the host's triple), so
# that build scripts and procedural macros are neither instrumented nor optimised by the
# profile. Needs nginx, wrk, curl, redis-server and llvm-profdata-N for rustc's LLVM major
# version N (Debian: `apt-get install llvm-N`; this script installs it with apt-get when it
# runs as root and the package exists). benches/load.sh uses this build unless PGO=0.
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN_SECS=${TRAIN_SECS:-5}
WHAT=${1:-tollgate}
[[ $WHAT == tollgate || $WHAT == floor ]] || { echo "usage: bash benches/pgo.sh [floor]" >&2; exit 2; }
die() { echo "pgo.sh: $*" >&2; exit 1; }
NEEDS=(nginx wrk curl)
[[ $WHAT == tollgate ]] && NEEDS+=(redis-server)   # the floor has no store
for t in "${NEEDS[@]}"; do
    command -v "$t" >/dev/null || die "$t is missing (Debian: apt-get install nginx wrk curl redis-server)"
done

# llvm-profdata must read what rustc's LLVM writes: the same major version.
llvm_major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
[[ -n $llvm_major ]] || die "cannot read rustc's LLVM version from \`rustc -vV\`"
find_profdata() {
    local c
    for c in "llvm-profdata-$llvm_major" "/usr/lib/llvm-$llvm_major/bin/llvm-profdata"; do
        command -v "$c" >/dev/null 2>&1 && { command -v "$c"; return; }
    done
    if command -v llvm-profdata >/dev/null 2>&1 \
        && llvm-profdata --version 2>/dev/null | grep -q "LLVM version $llvm_major\."; then
        command -v llvm-profdata
    fi
}
PROFDATA=$(find_profdata || true)
if [[ -z $PROFDATA && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "pgo.sh: installing llvm-$llvm_major for llvm-profdata (rustc uses LLVM $llvm_major)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "llvm-$llvm_major" >/dev/null \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "llvm-$llvm_major" >/dev/null; } \
        || true
    PROFDATA=$(find_profdata || true)
fi
[[ -n $PROFDATA ]] || die "llvm-profdata for LLVM $llvm_major not found (Debian: apt-get install llvm-$llvm_major)"

HOST=$(rustc -vV | sed -n 's/^host: //p')
if [[ $WHAT == floor ]]; then
    CRATE=(--manifest-path benches/floor/Cargo.toml) TD=benches/floor/target NAME=tollgate-floor
else
    CRATE=(--bin tollgate) TD=target NAME=tollgate
fi
RAW=$PWD/$TD/pgo-raw
rm -rf "$RAW"
echo "pgo.sh: building the instrumented $NAME ($TD/pgo-gen)" >&2
RUSTFLAGS="-Cprofile-generate=$RAW" cargo build --release --locked "${CRATE[@]}" \
    --target "$HOST" --target-dir "$TD/pgo-gen"
GEN=$TD/pgo-gen/$HOST/release/$NAME

D=$(mktemp -d)
PIDS=()
cleanup() {
    for p in ${PIDS[@]+"${PIDS[@]}"}; do kill "$p" 2>/dev/null || true; done
    [[ -s $D/nginx.pid ]] && kill "$(cat "$D/nginx.pid")" 2>/dev/null || true
    rm -rf "$D"
}
trap cleanup EXIT
# shellcheck source=benches/upstream.sh
source benches/upstream.sh
start_upstream "ok"
if [[ $WHAT == tollgate ]]; then
    start_redis
    PIDS+=("$REDIS_PID")
fi
# POST bodies for the API-key case.
cat >"$D/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = string.rep("x", 512)
wrk.headers["Content-Type"] = "application/octet-stream"
wrk.headers["Authorization"] = "Bearer pgo-train-key"
LUA

# One gateway per case: config, then `wrk` for TRAIN_SECS, then SIGTERM (the instrumented
# binary writes its counts when it exits).
train() { # name store quota path [wrk args...]
    local name=$1 store=$2 quota=$3 path=$4 p
    shift 4
    p=$(free_port)
    {
        printf '[server]\nlisten = "127.0.0.1:%s"\nshutdown_grace = "1s"\nwatch_config = false\n' "$p"
        printf '[log]\nlevel = "warn"\n'
        if [[ $store == redis ]]; then
            printf '[store]\nbackend = "redis"\n[[store.shards]]\nprimary = "redis://127.0.0.1:%s"\n' "$RP"
        else
            printf '[store]\nbackend = "memory"\n'
        fi
        # key_sha256 = sha256("pgo-train-key")
        printf '[[identity.clients]]\nid = "trainer"\nkey_sha256 = "%s"\ntier = "default"\n' \
            "$(printf %s pgo-train-key | sha256sum | cut -d' ' -f1)"
        printf '[[upstreams]]\nname = "up"\ntargets = ["http://127.0.0.1:%s"]\n' "$UP"
        printf '[[limits]]\nname = "core"\nwindow = "1h"\nquota = { anonymous = %s, default = %s }\n' "$quota" "$quota"
        printf '[[limits]]\nname = "search"\nwindow = "1m"\nquota = { anonymous = %s, default = %s }\n' "$quota" "$quota"
        printf '[[routes]]\npath_prefix = "/"\nupstream = "up"\nlimits = ["core"]\n'
        printf '[[routes]]\npath_prefix = "/search"\nupstream = "up"\nlimits = ["core", "search"]\n'
    } >"$D/$name.toml"
    "$GEN" run --config "$D/$name.toml" >"$D/$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$p/" && break; sleep 0.1; done
    wrk -t1 -c64 "-d${TRAIN_SECS}s" "$@" "http://127.0.0.1:$p$path" | awk -v n="$name" '/Requests\/sec/ { print "pgo.sh: " n ": " $2 " req/s" }' >&2
    kill -TERM "$pid"
    wait "$pid" || true
}
# The floor: WORKERS = cores, as load.sh runs it; FLOOR_EXIT_AFTER makes it exit (and write
# its counts) a second after wrk ends.
train_floor() { # name [env...]
    local name=$1 p
    shift
    p=$(free_port)
    env "$@" FLOOR_EXIT_AFTER=$(( TRAIN_SECS + 2 )) "$GEN" "127.0.0.1:$p" "127.0.0.1:$UP" >"$D/$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$p/" && break; sleep 0.05; done
    wrk -t1 -c64 "-d${TRAIN_SECS}s" "http://127.0.0.1:$p/" | awk -v n="$name" '/Requests\/sec/ { print "pgo.sh: " n ": " $2 " req/s" }' >&2
    wait "$pid" || true
}
if [[ $WHAT == floor ]]; then
    train_floor floor
    train_floor floor_contract FLOOR_CONTRACT=1
else
    train memory memory 1000000000000 /
    train api_key memory 1000000000000 /search/items -s "$D/post.lua"
    train refused memory 5 /
    train redis redis 1000000000000 /
fi
compgen -G "$RAW/*.profraw" >/dev/null || die "the instrumented runs wrote no profile under $RAW"

"$PROFDATA" merge -o "$TD/pgo-merged.profdata" "$RAW"
echo "pgo.sh: building $NAME with the profile ($TD/pgo-use)" >&2
RUSTFLAGS="-Cprofile-use=$PWD/$TD/pgo-merged.profdata" cargo build --release --locked "${CRATE[@]}" \
    --target "$HOST" --target-dir "$TD/pgo-use"
mkdir -p "$TD/pgo"
cp "$TD/pgo-use/$HOST/release/$NAME" "$TD/pgo/$NAME"
echo "pgo.sh: $TD/pgo/$NAME" >&2
