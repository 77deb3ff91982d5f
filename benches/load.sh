#!/usr/bin/env bash
# benches/load.sh — one-command load harness: tollgate against nginx baselines on this machine.
#
# Usage (as root when packages are missing; run from anywhere inside the repo):
#   bash benches/load.sh                                       # everything, defaults below
#   DURATION=2s ROUNDS=1 SKIP_1M=1 bash benches/load.sh        # a quick try
#   CASES="direct nginx_proxy tg_memory" SKIP_HALFLOAD=1 bash benches/load.sh
#   DURATION=2s ROUNDS=1 SKIP_1M=1 SKIP_HALFLOAD=1 CASES="nginx_proxy hyper_floor tg_memory" bash benches/load.sh
#
# Env knobs [default]:
#   DURATION [10s]       wrk -d of each measured run (wrk syntax: 10s, 1m)
#   ROUNDS [2]           interleaved rounds: every selected case runs once per round, in order
#   CASES [all]          space-separated subset of the case names below (for quick tries)
#   SKIP_INSTALL [0]     1: never apt-get; fail when a tool is missing
#   PGO [1]              1: build tollgate with benches/pgo.sh (profile-guided: the release build
#                        laid out by a profile of the gateway under load) and measure
#                        target/pgo/tollgate; 0: `cargo build --release` and target/release/tollgate
#   SKIP_BUILD [0]       1: don't run cargo build; measure the target/pgo/tollgate (PGO=0:
#                        target/release/tollgate) and benches/floor/target/release/tollgate-floor
#                        already there (and target/release/tollgate for tg_memory_plain)
#   TOLLGATE_BIN []      measure this binary instead (no build), e.g. an older release to compare
#   SKIP_HALFLOAD [0]    1: skip the half-load latency runs (h2load)
#   SKIP_1M [0]          1: skip the 1,000,000-distinct-callers memory run
#   SKIP_OWNWORK [0]     1: skip the criterion bench of tollgate's own work (benches/own_work.rs)
#   HALF_SECS [10]       h2load -D (seconds) of each half-load run
#   QUIET_PCT [15]       before each run, wait until the machine is less than QUIET_PCT % busy ...
#   QUIET_WAIT [30]      ... for at most QUIET_WAIT seconds (the box is shared with builds and tests)
#   OTHER_MAX [10]       a run in which more than OTHER_MAX % of the machine was busy with something
#   RETRIES [2]          other than the processes measured is repeated, up to RETRIES tries in all;
#                        a case whose run still exceeds it is flagged with * in the table
#   KEEP_WORK [0]        1: keep the work dir /tmp/tollgate-load.XXXXXX (always kept on failure)
#
# What it does, in order:
#   1. Installs what is missing with apt-get (wrk, nginx, libnginx-mod-http-lua, nghttp2-client for
#      h2load, redis-server/redis-tools, curl, iproute2, procps, python3), with a temporary
#      /usr/sbin/policy-rc.d that exits 101 so Debian does not start system services (restored
#      afterwards). Runs `bash benches/pgo.sh` (PGO=0: `cargo build --release --bin tollgate`;
#      neither when SKIP_BUILD=1; with PGO=1 the plain `cargo build --release` too, for tg_memory_plain) and copies the binary into the work dir, so a rebuild by someone else during the run changes nothing.
#      For hyper_floor, builds benches/floor (its own package, not part of tollgate's build) with
#      `cargo build --release --manifest-path benches/floor/Cargo.toml` (unless SKIP_BUILD=1) and
#      copies that binary too. Unless SKIP_OWNWORK=1, builds the criterion bench
#      `cargo bench --bench own_work --no-run` (of the working tree, also when TOLLGATE_BIN is set).
#   2. Starts, on 127.0.0.1 and free ports, and kills on exit (only these PIDs, listed in the work
#      dir's pids.txt):
#      - nginx upstream: `return 200 "ok"`, worker_processes 1, keepalive_requests 1e9
#      - hyper floor (benches/floor, for hyper_floor): a minimal hyper 1.x proxy, one current_thread
#        runtime per core (WORKERS = nproc) each with its own SO_REUSEPORT listener, each downstream
#        connection keeping its own upstream connection; no header rewriting, no limits, no logs
#      - nginx proxy (worker_processes 1, upstream keepalive pool of 128):
#          /           plain proxy_pass
#          /redis-fw   access_by_lua: one EVALSHA fixed window (INCRBY + PEXPIRE) per request over a
#                      pooled cosocket, 503 on a Redis error, then proxy_pass
#          /lr-reject  limit_req at 1 r/m (limit_req_status 429): nearly every request is a 429
#      - nginx routes proxies, each its own nginx (worker_processes 1, the same upstream pool as the
#        nginx proxy), only when its case is selected, so that nginx_proxy's config stays as small:
#          nginx_one_route: one server, `location /` with a plain proxy_pass: the one-route twin
#          nginx_prefixes_10k: one server with the 10,000 prefixes of tg_prefixes_10k as
#                      `location /p0000` .. `location /p9999`, each a plain proxy_pass, and
#                      `location / { return 404; }` for any other path, as tollgate answers a path
#                      no route matches (nginx keeps prefix locations in a static tree sorted by
#                      name, searched by comparison: about log2(10,000) = 14 string comparisons
#                      below "/", whatever the position in the file; not a hash)
#          nginx_hosts_10k: one server whose `server_name` lists the 10,000 hosts of tg_hosts_10k
#                      (location / with a plain proxy_pass), beside a default_server that answers
#                      404 to any other host, as tollgate does (no route). With more than one server
#                      on a listen address, nginx finds the server for a Host in a hash of every
#                      server_name on that address (exact names), so the lookup is a hash lookup
#                      whether the 10,000 names sit in one server or in 10,000 servers; one server
#                      loads in 0.1 s and 10 MB, 10,000 server blocks in about 3 s and 210 MB (each
#                      block has its own configuration of every module). Without the default
#                      server nginx builds no hash at all (the one server gets every request).
#                      server_names_hash_max_size 16384 and server_names_hash_bucket_size 128 let
#                      nginx build that hash as sized (the defaults, 512 and 64, make it warn
#                      "could not build optimal server_names_hash" and fall back to long buckets
#                      scanned one name after another); the script fails on that warning.
#      - redis-server R0 for the one-shard cases; for tg_redis3_replicas three more primaries,
#        each with one replica (--replicaof)
#      - one tollgate per tg_* case, each with its own generated TOML ([log] level = "warn",
#        [store] on_error = "deny" so store failures show up as non-2xx, one [[limits]] "core" with
#        window = "1h", one route "/" -> the nginx upstream; tg_prefixes_10k and tg_hosts_10k: 10,000
#        routes instead, see below), validated by `tollgate check`.
#   3. Cases (wrk -t1 -c64 -d$DURATION --latency; a 2 s warm-up of every case first; then ROUNDS
#      interleaved rounds):
#        direct               wrk -> nginx upstream
#        nginx_proxy          wrk -> nginx proxy / -> upstream
#        nginx_lua_redis      wrk -> nginx proxy /redis-fw (one EVALSHA per request on R0) -> upstream
#        nginx_limit_req_429  wrk -> nginx proxy /lr-reject (~all 429)
#        hyper_floor          wrk -> hyper floor -> upstream: what hyper itself costs per proxied
#                             request; every tollgate case is reported as a ratio to it
#        hyper_floor_headers  like hyper_floor with FLOOR_HEADERS=1: the forwarded request and the
#                             response carry the header lines tollgate adds (X-Forwarded-*,
#                             X-Real-IP, X-Request-Id, Via; the five X-RateLimit-*) with fixed
#                             values: what carrying them costs hyper and the kernel, with none of
#                             the work of computing them
#        hyper_floor_429      wrk -> hyper floor answering every request itself with a fixed 429
#                             (`tollgate-floor LISTEN -`): what hyper alone costs per refusal, the
#                             floor of the 429 target
#        hyper_floor_429_headers like hyper_floor_429 with FLOOR_HEADERS=1: the fixed 429 carries
#                             the header lines (X-RateLimit-*, X-Request-Id) and the body of
#                             tollgate's 429 here, fixed: what hyper costs per refusal that says
#                             what the contract asks a 429 to say
#        hyper_floor_contract like hyper_floor with FLOOR_CONTRACT=1: the least work tollgate's
#                             contract asks of each of these requests, written plainly (hop-by-hop
#                             stripping, a caller by IP, one fixed window in a store the workers
#                             share, a request id, the forwarded and X-RateLimit-* lines computed,
#                             a response timeout, a latency histogram; benches/floor/src/contract.rs):
#                             how much of the CPU target the contract itself takes
#        hyper_floor_contract_429 the same with a quota of one: every request after the first is
#                             refused with a computed 429 (the contract's least work per refusal)
#        hyper_floor_pgo      like hyper_floor, the floor built profile-guided as tollgate is
#                             (`bash benches/pgo.sh floor`; with PGO=1 only): the floor of the CPU
#                             target with the same compiler help tollgate gets
#        tg_memory            memory store, one caller (wrk's IP), quota 1e12
#        tg_prefixes_10k      like tg_memory with 10,000 routes in place of "/": path_prefix = "/p0000"
#                             .. "/p9999" (in that order, all of the same length, each to the nginx
#                             upstream with limit core); wrk requests /p9999, the route a linear scan
#                             in config order (the router's order among prefixes of equal length)
#                             matches last, after walking all 10,000 (issue 46)
#        tg_hosts_10k         like tg_memory with 10,000 routes in place of "/": host = "t0.example.com"
#                             .. "t9999.example.com", each with path_prefix = "/"; wrk sends
#                             Host: t9999.example.com, the route a linear scan matches last (issue 46)
#                             tg_memory is the one-route config of the same shape (memory store, one
#                             caller, one limit core, one route "/"): issue 46's tg_routes_1, which
#                             both are compared with
#        nginx_prefixes_10k   wrk -> nginx with the same 10,000 prefixes as locations, GET /p9999
#        nginx_hosts_10k      wrk -> nginx with the same 10,000 hosts as server_names, Host:
#                             t9999.example.com
#        nginx_one_route      wrk -> an nginx like those two with one `location /` (the one-route twin
#                             of both; nginx_proxy's server also carries the Lua and limit_req
#                             locations, which made it costlier per request than the twins)
#        tg_memory_plain      like tg_memory, on the plain `cargo build --release` binary (with PGO=1
#                             only): tollgate built as hyper_floor is, the like-for-like ratio
#        tg_memory_w1         like tg_memory with `[server] workers = 1`: one runtime thread, as nginx
#                             here runs one worker process
#        tg_memory_per_core   like tg_memory with `[server] runtime = "per_core"`: one current_thread
#                             runtime and SO_REUSEPORT listener per core (issue 16 item 1)
#        tg_memory_many       memory store, a random caller per request: the wrk script sets
#                             X-Forwarded-For: 10.a.b.c, and trusted_proxies = ["127.0.0.1/32"];
#                             store.max_callers = 100,000,000 (the default million is reached)
#        tg_redis             Redis R0 (1 shard), one caller
#        tg_redis_per_core    like tg_redis with `[server] runtime = "per_core"`
#        tg_redis_many        Redis R0, random callers
#        tg_redis3_replicas   3 shards, each primary + 1 replica, read_from = "replica", random callers
#        tg_memory_429        memory store, quota 1, spent by one request before the run
#        tg_redis_429         Redis R0, quota 1, spent before the run (default over-limit cache)
#        tg_redis_64          Redis R0, 64 callers (a random one of 64 IPs per request): most
#                             requests find no other of their caller in flight
#        tg_redis_64_recent   like tg_redis_64 with `store.check_from_charge = "100ms"`: a CHECK is
#                             answered from the gateway's last CHARGE answer (one script call per
#                             request instead of two)
#        tg_redis_lease       like tg_redis with `lease = 100` on the limit; only when `tollgate check`
#                             accepts that key, else "skipped: lease not supported by this build"
#   4. Per run: req/s; p50/p90/p99/p99.9 (exact, from a wrk Lua done() that prints
#      latency:percentile()); non-2xx share; socket errors; CPU µs per request of the proxy or
#      gateway, the upstream, the redis-server(s) and wrk, from /proc/PID/stat utime+stime deltas
#      (wrk: its rusage); busy% (all cores) and other% = busy not accounted to those processes
#      (loopback softirq, kernel threads, anything else running on the box). For cases that use
#      Redis: "Redis calls" = delta over the run of the sum of calls= of all cmdstat_* lines of
#      INFO commandstats over every primary and replica of the case. Not counted: INFO (ours),
#      REPLCONF/PSYNC/SYNC, and on replicas the replication stream (MULTI, EXEC, SELECT, PING and
#      every @write command, which a replica only gets from its primary). Commands run inside a
#      Lua script are counted (Redis counts them in commandstats), so the "scripts" column also
#      gives EVAL/EVALSHA/FCALL(_RO) alone, i.e. round trips for a script-based store.
#      Reported per admitted (2xx) request and per request.
#   5. Latency at half load: h2load --h1 -t1 -c32 --rps=R/32 -D HALF_SECS against tg_memory and
#      tg_redis, R = half of that case's own mean req/s, and against direct at each of those R
#      (and hyper_floor at the R of tg_memory: what hyper alone adds there; nginx_lua_redis at
#      the R of tg_redis: what a proxy making one Redis round trip per request adds there);
#      p50/p90/p99/p99.9 from h2load's --log-file (3rd column: µs to end of response); repeated
#      like the wrk runs when other% is too high.
#   6. 1,000,000 distinct callers: a fresh memory-store tollgate, wrk with X-Forwarded-For
#      10.(n>>16&255).(n>>8&255).(n&255) for n = 1..1,000,000 (then n stays at 1,000,000), run for
#      1e6 / (tg_memory_many req/s) x 1.3 seconds (topped up with runs that continue from the next
#      caller when the machine was slower than that; 120 s in all at most); VmRSS and VmHWM after.
#   7. Binary size of the binary measured (target/pgo/tollgate, or as PGO and TOLLGATE_BIN say).
#   8. Own work (unless SKIP_OWNWORK=1), after every process above is stopped: `cargo bench --bench
#      own_work`, criterion's middle estimate of `own work/proxied request (memory store, 1 limit)`:
#      tollgate's own work for one proxied request with no I/O (see benches/own_work.rs).
#   9. Prints the summary and writes it into BENCHMARKS.md between the lines
#      <!-- load.sh:begin --> and <!-- load.sh:end --> (text outside them is kept; the file and
#      markers are created when missing): the tables, each tollgate case as a ratio to
#      hyper_floor and to nginx_proxy (req/s and CPU µs per request), and PASS/FAIL per target of
#      issue 16 (a target whose cases did not run is n/a):
#        - memory store: tg_memory req/s >= 1.0x nginx_proxy's, at CPU/req <= 1.0x nginx_proxy's
#        - CPU per proxied request: tg_memory's <= 1.2x hyper_floor's
#        - Redis, 1 shard, after_response: tg_redis req/s >= 0.8x nginx_proxy's and >= 1.5x
#          nginx_lua_redis's
#        - a 429 (memory store or over-limit cache): tg_memory_429 and tg_redis_429 req/s each
#          >= 0.95x direct's
#        - p99 added over direct at half of the case's own peak <= 1 ms (tg_memory, tg_redis)
#        - own work <= 2 µs (the criterion bench above)
#        - release binary <= 12 MB (12,000,000 bytes)
#      and of issue 46 (routing at scale, each on the route matched last, one run):
#        - gateway CPU per request of tg_prefixes_10k and of tg_hosts_10k <= 1.05x tg_memory's (the
#          one-route config)
#        - their gateway CPU per request as a ratio to their nginx twin's (nginx_prefixes_10k,
#          nginx_hosts_10k) no worse (no higher) than tg_memory's to nginx_one_route's
#      with a table of those ratios (CPU per request, and req/s beside it),
#      and the earlier targets kept: Redis round trips (judged on script calls; commandstats' sum,
#      which also counts the commands the scripts run, is printed beside it) and 1M callers'
#      memory. Draws benches/latency.svg with benches/plot.py. A run with DURATION < 10s, one
#      round or a CASES subset is marked as a partial run (a quick try, not a reference).
# A default run takes about 8.5 minutes on a quiet 2-core machine, plus the build and any waits for
# a quiet machine. Raw outputs are in the work dir.
# Every process shares this machine's cores with wrk: compare rows with each other.

set -Eeuo pipefail

DURATION=${DURATION:-10s}
ROUNDS=${ROUNDS:-2}
CASES=${CASES:-}
SKIP_INSTALL=${SKIP_INSTALL:-0}
SKIP_BUILD=${SKIP_BUILD:-0}
PGO=${PGO:-1}
SKIP_HALFLOAD=${SKIP_HALFLOAD:-0}
SKIP_1M=${SKIP_1M:-0}
SKIP_OWNWORK=${SKIP_OWNWORK:-0}
HALF_SECS=${HALF_SECS:-10}
QUIET_PCT=${QUIET_PCT:-15}
QUIET_WAIT=${QUIET_WAIT:-30}
OTHER_MAX=${OTHER_MAX:-10}
RETRIES=${RETRIES:-2}
KEEP_WORK=${KEEP_WORK:-0}
CONNS=64
WARMUP=2s

# Routing at scale (issue 46): this many routes, prefixes "/p0000".. or hosts "t0.example.com"..
# (at most 10,000: the prefixes are written /p%04d, so that all are of one length).
ROUTES_N=10000
ROUTES_TXT=$(awk -v n="$ROUTES_N" 'BEGIN { s = sprintf("%d", n); while (s ~ /[0-9][0-9][0-9][0-9]/) sub(/[0-9][0-9][0-9]($|,)/, ",&", s); print s }')
LAST_PREFIX=$(printf '/p%04d' $(( ROUTES_N - 1 )))
LAST_HOST="t$(( ROUTES_N - 1 )).example.com"

ALL_CASES=(direct nginx_proxy nginx_lua_redis nginx_limit_req_429 nginx_one_route nginx_prefixes_10k nginx_hosts_10k
    hyper_floor hyper_floor_pgo hyper_floor_headers hyper_floor_429 hyper_floor_429_headers hyper_floor_contract
    hyper_floor_contract_429 tg_memory tg_prefixes_10k tg_hosts_10k tg_memory_plain tg_memory_w1 tg_memory_per_core
    tg_memory_many tg_redis tg_redis_per_core tg_redis_many tg_redis3_replicas tg_memory_429 tg_redis_429 tg_redis_lease
    tg_redis_64 tg_redis_64_recent)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="$(mktemp -d /tmp/tollgate-load.XXXXXX)"
RAW="$WORK/raw"
LOGS="$WORK/logs"
mkdir -p "$RAW" "$LOGS"
CLK_TCK=$(getconf CLK_TCK)
NCPU=$(nproc)
START_TIME=$SECONDS

PIDS=()
POLICY_BACKUP=""
FAILED=1

log() { printf '[load %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
trap 'log "ERROR: line $LINENO: \"$BASH_COMMAND\" failed"' ERR

restore_policy() {
    [[ -n "$POLICY_BACKUP" ]] || return 0
    if [[ "$POLICY_BACKUP" == none ]]; then rm -f /usr/sbin/policy-rc.d
    else mv -f "$POLICY_BACKUP" /usr/sbin/policy-rc.d; fi
    POLICY_BACKUP=""
}

# Stop one process we started: SIGTERM, then SIGKILL after 5 s.
stop_pid() {
    local pid=$1 i
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    local rc=$? pid
    trap - ERR
    restore_policy
    for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
    if [[ "$FAILED" == 0 && "$KEEP_WORK" != 1 ]]; then
        rm -rf "$WORK"
    else
        log "work dir kept: $WORK (logs in $LOGS, raw outputs in $RAW)"
    fi
    return "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------- arguments

SELECTED=()
if [[ -z "$CASES" ]]; then
    SELECTED=("${ALL_CASES[@]}")
else
    for c in $CASES; do
        [[ " ${ALL_CASES[*]} " == *" $c "* ]] || die "unknown case '$c' in CASES (known: ${ALL_CASES[*]})"
    done
    for c in "${ALL_CASES[@]}"; do [[ " $CASES " == *" $c "* ]] && SELECTED+=("$c"); done
fi
selected() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }
drop_case() { local c n=(); for c in "${SELECTED[@]}"; do [[ "$c" == "$1" ]] || n+=("$c"); done; SELECTED=("${n[@]}"); }

duration_secs() {
    case "$1" in
        *ms) echo 1 ;;
        *s) echo "${1%s}" ;;
        *m) echo $(( ${1%m} * 60 )) ;;
        *h) echo $(( ${1%h} * 3600 )) ;;
        *) echo "$1" ;;
    esac
}
DUR_S=$(duration_secs "$DURATION")
[[ "$DUR_S" =~ ^[0-9]+$ && "$DUR_S" -ge 1 ]] || die "DURATION must look like 10s or 1m (got '$DURATION')"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer (got '$ROUNDS')"
[[ "$HALF_SECS" =~ ^[1-9][0-9]*$ ]] || die "HALF_SECS must be a positive integer (got '$HALF_SECS')"

# ---------------------------------------------------------------------------- install

LUA_MOD=/usr/lib/nginx/modules/ngx_http_lua_module.so
NDK_MOD=/usr/lib/nginx/modules/ndk_http_module.so

install_deps() {
    local need=() p
    command -v wrk >/dev/null || need+=(wrk)
    command -v nginx >/dev/null || need+=(nginx)
    [[ -f "$LUA_MOD" && -f "$NDK_MOD" ]] || need+=(libnginx-mod-http-lua)
    command -v h2load >/dev/null || need+=(nghttp2-client)
    command -v redis-server >/dev/null || need+=(redis-server)
    command -v redis-cli >/dev/null || need+=(redis-tools)
    command -v curl >/dev/null || need+=(curl)
    command -v ss >/dev/null || need+=(iproute2)
    command -v pgrep >/dev/null || need+=(procps)
    command -v python3 >/dev/null || need+=(python3)
    ((${#need[@]})) || return 0
    [[ "$SKIP_INSTALL" == 1 ]] && die "missing: ${need[*]} (SKIP_INSTALL=1, so not installing)"
    [[ $EUID -eq 0 ]] || die "missing: ${need[*]}; run as root to install them with apt-get"
    log "installing with apt-get: ${need[*]}"
    # Keep the packages' maintainer scripts from starting system services (nginx, redis) while
    # installing: policy-rc.d exiting 101 forbids it. Whatever was there is restored afterwards.
    if [[ -e /usr/sbin/policy-rc.d ]]; then
        POLICY_BACKUP="$WORK/policy-rc.d.orig"
        cp -a /usr/sbin/policy-rc.d "$POLICY_BACKUP"
    else
        POLICY_BACKUP=none
    fi
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    apt-get update -qq >"$LOGS/apt.log" 2>&1 || log "apt-get update failed (see $LOGS/apt.log); trying anyway"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" \
        >>"$LOGS/apt.log" 2>&1 || { restore_policy; die "apt-get install failed (see $LOGS/apt.log)"; }
    restore_policy
    for p in wrk nginx h2load redis-server redis-cli curl ss pgrep python3; do
        command -v "$p" >/dev/null || die "$p is still missing after apt-get"
    done
}
install_deps
HAVE_LUA=0
[[ -f "$LUA_MOD" && -f "$NDK_MOD" ]] && HAVE_LUA=1

BUILT=target/release/tollgate BUILD_KIND="cargo build --release"
[[ "$PGO" == 1 ]] && BUILT=target/pgo/tollgate BUILD_KIND="benches/pgo.sh (profile-guided release build)"
BIN=${TOLLGATE_BIN:-$BUILT}
if [[ -n "${TOLLGATE_BIN:-}" ]]; then
    log "not building: measuring TOLLGATE_BIN=$TOLLGATE_BIN"
    [[ -x "$BIN" ]] || die "TOLLGATE_BIN=$TOLLGATE_BIN is not an executable"
    BUILD_KIND="TOLLGATE_BIN=$TOLLGATE_BIN"
elif [[ "$SKIP_BUILD" == 1 ]]; then
    log "not building (SKIP_BUILD=1): using $BUILT as it is"
    [[ -x "$BUILT" ]] || die "$BUILT does not exist"
else
    command -v cargo >/dev/null || die "cargo is missing (install Rust from https://rustup.rs)"
    if [[ "$PGO" == 1 ]]; then
        log "building: bash benches/pgo.sh (two release builds and a minute of training; PGO=0: a plain release build)"
        bash benches/pgo.sh >"$LOGS/build.log" 2>&1 \
            || { tail -n 40 "$LOGS/build.log" >&2; die "benches/pgo.sh failed (PGO=0 measures a plain release build)"; }
    else
        log "building: cargo build --release --bin tollgate"
        cargo build --release --bin tollgate 2>"$LOGS/build.log" \
            || { tail -n 40 "$LOGS/build.log" >&2; die "cargo build failed (SKIP_BUILD=1 measures the existing binary)"; }
    fi
fi
BIN_SIZE=$(stat -c %s "$BIN")
VERSIONS="$(nginx -v 2>&1 | sed 's/^nginx version: //'); redis $(redis-server --version | awk '{ sub(/^v=/, "", $3); print $3 }'); wrk $( (wrk -v 2>&1 || true) | awk 'NR == 1 { print $2 }'); $(h2load --version | awk 'NR == 1')"
TG="$WORK/tollgate"
cp "$BIN" "$TG"

# side_binary WHAT BUILT DEST LOG CMD...: build BUILT with CMD (its output in $LOGS/LOG), or with
# SKIP_BUILD=1 take BUILT as it is, then copy it to DEST. WHAT names the cases it is for.
side_binary() {
    local what=$1 built=$2 dest=$3 out=$4
    shift 4
    if [[ "$SKIP_BUILD" == 1 ]]; then
        log "not building (SKIP_BUILD=1): using $built as it is ($what)"
        [[ -x "$built" ]] || die "$built does not exist (run: $*; or leave $what out of CASES)"
    else
        command -v cargo >/dev/null || die "cargo is missing (install Rust from https://rustup.rs)"
        log "building: $* ($what)"
        "$@" >"$LOGS/$out" 2>&1 || { tail -n 40 "$LOGS/$out" >&2; die "$* failed ($what)"; }
    fi
    cp "$built" "$dest"
}

# Beside a plain tollgate (PGO=0, or TOLLGATE_BIN), the profile-guided floor would compare unlike
# builds, and tollgate's plain build is tg_memory itself.
if [[ "$PGO" != 1 || -n "${TOLLGATE_BIN:-}" ]]; then
    selected hyper_floor_pgo && drop_case hyper_floor_pgo
    selected tg_memory_plain && drop_case tg_memory_plain
fi

# tollgate's plain release build beside the profile-guided one (tg_memory_plain).
TG_PLAIN="$WORK/tollgate-plain"
selected tg_memory_plain \
    && side_binary tg_memory_plain target/release/tollgate "$TG_PLAIN" build-plain.log \
        cargo build --release --bin tollgate

# The hyper floor: its own package under benches/floor (its own Cargo.lock and target dir).
FLOOR_DIR="$ROOT/benches/floor"
FLOOR="$WORK/tollgate-floor"
if selected hyper_floor || selected hyper_floor_headers || selected hyper_floor_429 \
    || selected hyper_floor_429_headers || selected hyper_floor_contract || selected hyper_floor_contract_429; then
    side_binary "hyper_floor and its variants" "$FLOOR_DIR/target/release/tollgate-floor" "$FLOOR" floor-build.log \
        cargo build --release --manifest-path "$FLOOR_DIR/Cargo.toml" --target-dir "$FLOOR_DIR/target"
fi
# The floor built profile-guided (hyper_floor_pgo): only beside a profile-guided tollgate.
FLOORP="$WORK/tollgate-floor-pgo"
selected hyper_floor_pgo \
    && side_binary hyper_floor_pgo "$FLOOR_DIR/target/pgo/tollgate-floor" "$FLOORP" floor-pgo-build.log \
        bash benches/pgo.sh floor

# The own-work bench: built now (while nothing is measured), run after the load runs.
OWN_US="" OWN_RANGE="" OWN_NOTE=""
OWN_BENCH="own work/proxied request (memory store, 1 limit)"
if [[ "$SKIP_OWNWORK" == 1 ]]; then
    OWN_NOTE="skipped (SKIP_OWNWORK=1)"
else
    command -v cargo >/dev/null || die "cargo is missing (install Rust from https://rustup.rs); SKIP_OWNWORK=1 skips the own-work bench"
    log "building: cargo bench --bench own_work --no-run"
    cargo bench --bench own_work --no-run 2>"$LOGS/own-work-build.log" \
        || { tail -n 40 "$LOGS/own-work-build.log" >&2; die "building benches/own_work.rs failed (SKIP_OWNWORK=1 skips it)"; }
fi

# ---------------------------------------------------------------------------- processes

TAKEN=" "
# free_port VAR: a port below the kernel's ephemeral range (where outgoing connections take
# their local ports, which a listener then cannot bind) that no socket uses and that we have
# not handed out.
EPHEMERAL_LOW=$(awk '{ print $1 }' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
free_port() {
    local p i
    for i in $(seq 500); do
        p=$(( 10000 + RANDOM % (EPHEMERAL_LOW - 10000) ))
        [[ "$TAKEN" == *" $p "* ]] && continue
        if [[ -z "$(ss -tanH "sport = :$p")" ]]; then
            TAKEN+="$p "
            printf -v "$1" '%s' "$p"
            return 0
        fi
    done
    die "no free port found"
}

# start_bg LOGFILE CMD...: run CMD in the background, remember its PID (LAST_PID) for cleanup.
start_bg() {
    local logf=$1
    shift
    "$@" >"$logf" 2>&1 &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
    echo "$LAST_PID $*" >>"$WORK/pids.txt"
}

# wait_port PID PORT NAME LOGFILE: until PORT accepts connections (15 s at most).
wait_port() {
    local pid=$1 port=$2 name=$3 logf=$4 i
    for i in $(seq 150); do
        kill -0 "$pid" 2>/dev/null || { cat "$logf" >&2 || true; die "$name exited during start-up"; }
        [[ -n "$(ss -ltnH "sport = :$port")" ]] && return 0
        sleep 0.1
    done
    cat "$logf" >&2 || true
    die "$name did not listen on 127.0.0.1:$port within 15 s"
}

# status URL [HOST]: HTTP status of one GET (with that Host header).
status() {
    curl -s -o /dev/null -w '%{http_code}' --max-time 5 ${2:+-H "Host: $2"} "$1" || true
}

# ---- Redis
declare -A RPORT=() RPID=()
start_redis() { # NAME [PRIMARY_NAME]
    local name=$1 primary=${2:-} port dir
    free_port port
    dir="$WORK/redis-$name"
    mkdir -p "$dir"
    local args=(--bind 127.0.0.1 --port "$port" --save "" --appendonly no --dir "$dir" --daemonize no)
    [[ -n "$primary" ]] && args+=(--replicaof 127.0.0.1 "${RPORT[$primary]}")
    start_bg "$LOGS/redis-$name.log" redis-server "${args[@]}"
    RPORT[$name]=$port
    RPID[$name]=$LAST_PID
    wait_port "$LAST_PID" "$port" "redis-server $name" "$LOGS/redis-$name.log"
}
wait_replica() {
    local name=$1 i
    for i in $(seq 150); do
        [[ "$(redis-cli -p "${RPORT[$name]}" INFO replication)" == *master_link_status:up* ]] && return 0
        sleep 0.1
    done
    die "replica $name did not sync with its primary within 15 s"
}

NEED_R3=0
selected tg_redis3_replicas && NEED_R3=1
start_redis r0
if ((NEED_R3)); then
    for i in 1 2 3; do
        start_redis "s$i"
        start_redis "s${i}r" "s$i"
    done
    for i in 1 2 3; do wait_replica "s${i}r"; done
fi
# Commands of the @write category: on a replica they only come from its primary.
WRITE_CMDS=" $(redis-cli -p "${RPORT[r0]}" COMMAND LIST FILTERBY ACLCAT write | tr '\n' ' ') "

# ---- nginx
free_port UP_PORT
free_port PROXY_PORT
mkdir -p "$WORK/nginx-up" "$WORK/nginx-proxy"
cat >"$WORK/fw.lua" <<'EOF'
local c = redis.call('INCRBY', KEYS[1], ARGV[1]); if c == tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end; return c
EOF
FW_SHA=$(redis-cli -p "${RPORT[r0]}" SCRIPT LOAD "$(cat "$WORK/fw.lua")")
[[ "$FW_SHA" =~ ^[0-9a-f]{40}$ ]] || die "SCRIPT LOAD failed: $FW_SHA"

nginx_common() { # PREFIX
    cat <<EOF
worker_processes 1;
pid $1/nginx.pid;
error_log $1/error.log warn;
events { worker_connections 8192; }
EOF
}
nginx_http_common() { # PREFIX
    cat <<EOF
  access_log off;
  client_body_temp_path $1/body;
  proxy_temp_path $1/proxy;
  fastcgi_temp_path $1/fastcgi;
  uwsgi_temp_path $1/uwsgi;
  scgi_temp_path $1/scgi;
  keepalive_requests 1000000000;
  keepalive_timeout 300s;
EOF
}
{
    nginx_common "$WORK/nginx-up"
    echo "http {"
    nginx_http_common "$WORK/nginx-up"
    cat <<EOF
  server {
    listen 127.0.0.1:$UP_PORT backlog=4096;
    default_type text/plain;
    location / { return 200 "ok"; }
  }
}
EOF
} >"$WORK/nginx-up.conf"

write_proxy_conf() { # WITH_LUA(0/1)
    {
        if [[ "$1" == 1 ]]; then
            echo "load_module $NDK_MOD;"
            echo "load_module $LUA_MOD;"
        fi
        nginx_common "$WORK/nginx-proxy"
        echo "http {"
        nginx_http_common "$WORK/nginx-proxy"
        cat <<EOF
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  upstream up { server 127.0.0.1:$UP_PORT; keepalive 128; keepalive_requests 1000000000; }
  limit_req_zone \$binary_remote_addr zone=lr_reject:1m rate=1r/m;
  limit_req_status 429;
  limit_req_log_level info;
  server {
    listen 127.0.0.1:$PROXY_PORT backlog=4096;
    location / { proxy_pass http://up; }
    location /lr-reject { limit_req zone=lr_reject; proxy_pass http://up; }
EOF
        if [[ "$1" == 1 ]]; then
            # One EVALSHA of a fixed window (INCRBY + PEXPIRE on the first hit) per request, over
            # a cosocket kept in nginx's keepalive pool; 503 when Redis fails (like on_error = deny).
            sed -e "s/@REDIS_PORT@/${RPORT[r0]}/" -e "s/@SHA@/$FW_SHA/" <<'EOF'
    location /redis-fw {
      access_by_lua_block {
        local sock = ngx.socket.tcp()
        sock:settimeouts(200, 200, 200)
        local ok, err = sock:connect("127.0.0.1", @REDIS_PORT@)
        if not ok then ngx.log(ngx.ERR, "redis connect: ", err); return ngx.exit(503) end
        local key = "rl:" .. ngx.var.remote_addr
        local cmd = "*6\r\n$7\r\nEVALSHA\r\n$40\r\n@SHA@\r\n$1\r\n1\r\n$" .. #key .. "\r\n" .. key
                    .. "\r\n$1\r\n1\r\n$7\r\n3600000\r\n"
        local _, serr = sock:send(cmd)
        if serr then ngx.log(ngx.ERR, "redis send: ", serr); sock:close(); return ngx.exit(503) end
        local line, rerr = sock:receive("*l")
        if not line then ngx.log(ngx.ERR, "redis receive: ", rerr); sock:close(); return ngx.exit(503) end
        sock:setkeepalive(30000, 128)
        if string.byte(line, 1) ~= 58 then ngx.log(ngx.ERR, "redis reply: ", line); return ngx.exit(503) end
        if tonumber(string.sub(line, 2)) > 1000000000000 then return ngx.exit(429) end
      }
      proxy_pass http://up;
    }
EOF
        fi
        echo "  }"
        echo "}"
    } >"$WORK/nginx-proxy.conf"
}
if ((HAVE_LUA)); then
    write_proxy_conf 1
    if ! nginx -t -q -p "$WORK/nginx-proxy" -e "$LOGS/nginx-proxy-t.err" -c "$WORK/nginx-proxy.conf" \
        >"$LOGS/nginx-proxy-t.log" 2>&1; then
        log "nginx rejects the Lua config (see $LOGS/nginx-proxy-t.*): no nginx_lua_redis"
        HAVE_LUA=0
    fi
fi
if ((!HAVE_LUA)); then
    write_proxy_conf 0
    selected nginx_lua_redis && log "skipped: nginx_lua_redis (ngx_http_lua_module not usable)"
    drop_case nginx_lua_redis
fi
start_bg "$LOGS/nginx-up.log" \
    nginx -p "$WORK/nginx-up" -e "$WORK/nginx-up/error.log" -c "$WORK/nginx-up.conf" -g 'daemon off;'
NGINX_UP_MASTER=$LAST_PID
wait_port "$NGINX_UP_MASTER" "$UP_PORT" "nginx upstream" "$WORK/nginx-up/error.log"
start_bg "$LOGS/nginx-proxy.log" \
    nginx -p "$WORK/nginx-proxy" -e "$WORK/nginx-proxy/error.log" -c "$WORK/nginx-proxy.conf" -g 'daemon off;'
NGINX_PROXY_MASTER=$LAST_PID
wait_port "$NGINX_PROXY_MASTER" "$PROXY_PORT" "nginx proxy" "$WORK/nginx-proxy/error.log"

# ---- nginx with the routes of tg_prefixes_10k / tg_hosts_10k (issue 46): an nginx of its own
# each, so that nginx_proxy's config stays the one-route twin.
# write_routes_conf KIND(prefixes|hosts) PORT: $WORK/nginx-KIND.conf.
write_routes_conf() {
    local kind=$1 port=$2 dir="$WORK/nginx-$1"
    mkdir -p "$dir"
    {
        nginx_common "$dir"
        echo "http {"
        nginx_http_common "$dir"
        cat <<EOF
  proxy_http_version 1.1;
  proxy_set_header Connection "";
  upstream up { server 127.0.0.1:$UP_PORT; keepalive 128; keepalive_requests 1000000000; }
EOF
        if [[ "$kind" == one ]]; then
            # The one-route twin of the two below: the same nginx, one location "/".
            echo "  server {"
            echo "    listen 127.0.0.1:$port backlog=4096;"
            echo "    location / { proxy_pass http://up; }"
            echo "  }"
        elif [[ "$kind" == prefixes ]]; then
            # location /p0000 .. /p9999: nginx's static location tree, searched by comparison; any
            # other path 404, as tollgate answers a path no route matches.
            echo "  server {"
            echo "    listen 127.0.0.1:$port backlog=4096;"
            echo "    location / { return 404; }"
            awk -v n="$ROUTES_N" 'BEGIN { for (i = 0; i < n; i++) printf "    location /p%04d { proxy_pass http://up; }\n", i }'
            echo "  }"
        else
            # One server with every name, beside a default server that answers other hosts 404:
            # nginx then finds the server by a hash of the names on this address, sized here so
            # that nginx builds it as asked (the defaults make it fall back to long buckets).
            cat <<EOF
  server_names_hash_max_size 16384;
  server_names_hash_bucket_size 128;
  server {
    listen 127.0.0.1:$port default_server backlog=4096;
    location / { return 404; }
  }
  server {
    listen 127.0.0.1:$port;
EOF
            awk -v n="$ROUTES_N" 'BEGIN { for (i = 0; i < n; i++) printf "    server_name t%d.example.com;\n", i }'
            echo "    location / { proxy_pass http://up; }"
            echo "  }"
        fi
        echo "}"
    } >"$WORK/nginx-$kind.conf"
}
# start_routes_nginx KIND: write, test and start it; sets ROUTES_PORT and ROUTES_MASTER.
start_routes_nginx() {
    local kind=$1
    free_port ROUTES_PORT
    write_routes_conf "$kind" "$ROUTES_PORT"
    nginx -t -p "$WORK/nginx-$kind" -e "$LOGS/nginx-$kind-t.err" -c "$WORK/nginx-$kind.conf" \
        >"$LOGS/nginx-$kind-t.log" 2>&1 \
        || { cat "$LOGS/nginx-$kind-t.log" >&2; die "nginx rejects the generated $WORK/nginx-$kind.conf"; }
    if grep -q 'could not build' "$LOGS/nginx-$kind-t.log"; then
        cat "$LOGS/nginx-$kind-t.log" >&2
        die "nginx could not build its server_names hash as sized in $WORK/nginx-$kind.conf"
    fi
    start_bg "$LOGS/nginx-$kind.log" \
        nginx -p "$WORK/nginx-$kind" -e "$WORK/nginx-$kind/error.log" -c "$WORK/nginx-$kind.conf" -g 'daemon off;'
    ROUTES_MASTER=$LAST_PID
    wait_port "$ROUTES_MASTER" "$ROUTES_PORT" "nginx ($kind)" "$WORK/nginx-$kind/error.log"
}
if selected nginx_one_route; then
    start_routes_nginx one
    NGINX_ONE_PORT=$ROUTES_PORT NGINX_ONE_MASTER=$ROUTES_MASTER
fi
if selected nginx_prefixes_10k; then
    start_routes_nginx prefixes
    NGINX_PFX_PORT=$ROUTES_PORT NGINX_PFX_MASTER=$ROUTES_MASTER
fi
if selected nginx_hosts_10k; then
    start_routes_nginx hosts
    NGINX_HOSTS_PORT=$ROUTES_PORT NGINX_HOSTS_MASTER=$ROUTES_MASTER
fi
sleep 0.3
# CPU of nginx = master + its workers.
UP_PIDS="$NGINX_UP_MASTER $(pgrep -P "$NGINX_UP_MASTER" | tr '\n' ' ')"
PROXY_PIDS="$NGINX_PROXY_MASTER $(pgrep -P "$NGINX_PROXY_MASTER" | tr '\n' ' ')"
PFX_PIDS="" HOSTS_PIDS="" ONE_PIDS=""
selected nginx_one_route && ONE_PIDS="$NGINX_ONE_MASTER $(pgrep -P "$NGINX_ONE_MASTER" | tr '\n' ' ')"
selected nginx_prefixes_10k && PFX_PIDS="$NGINX_PFX_MASTER $(pgrep -P "$NGINX_PFX_MASTER" | tr '\n' ' ')"
selected nginx_hosts_10k && HOSTS_PIDS="$NGINX_HOSTS_MASTER $(pgrep -P "$NGINX_HOSTS_MASTER" | tr '\n' ' ')"

# ---- the hyper floor: one runtime (thread) per core, like tollgate's default
FLOOR_PID=""
if selected hyper_floor_429; then
    free_port FLOOR429_PORT
    start_bg "$LOGS/floor429.log" env WORKERS="$NCPU" "$FLOOR" "127.0.0.1:$FLOOR429_PORT" -
    FLOOR429_PID=$LAST_PID
    wait_port "$FLOOR429_PID" "$FLOOR429_PORT" "hyper floor (429)" "$LOGS/floor429.log"
fi
if selected hyper_floor_429_headers; then
    free_port FLOOR429H_PORT
    start_bg "$LOGS/floor429h.log" env WORKERS="$NCPU" FLOOR_HEADERS=1 "$FLOOR" "127.0.0.1:$FLOOR429H_PORT" -
    FLOOR429H_PID=$LAST_PID
    wait_port "$FLOOR429H_PID" "$FLOOR429H_PORT" "hyper floor (429 with headers)" "$LOGS/floor429h.log"
fi
if selected hyper_floor; then
    free_port FLOOR_PORT
    start_bg "$LOGS/floor.log" env WORKERS="$NCPU" "$FLOOR" "127.0.0.1:$FLOOR_PORT" "127.0.0.1:$UP_PORT"
    FLOOR_PID=$LAST_PID
    wait_port "$FLOOR_PID" "$FLOOR_PORT" "hyper floor" "$LOGS/floor.log"
fi
if selected hyper_floor_pgo; then
    free_port FLOORP_PORT
    start_bg "$LOGS/floorp.log" env WORKERS="$NCPU" "$FLOORP" "127.0.0.1:$FLOORP_PORT" "127.0.0.1:$UP_PORT"
    FLOORP_PID=$LAST_PID
    wait_port "$FLOORP_PID" "$FLOORP_PORT" "hyper floor (profile-guided)" "$LOGS/floorp.log"
fi
if selected hyper_floor_contract; then
    free_port FLOORC_PORT
    start_bg "$LOGS/floorc.log" env WORKERS="$NCPU" FLOOR_CONTRACT=1 "$FLOOR" "127.0.0.1:$FLOORC_PORT" "127.0.0.1:$UP_PORT"
    FLOORC_PID=$LAST_PID
    wait_port "$FLOORC_PID" "$FLOORC_PORT" "hyper floor (contract)" "$LOGS/floorc.log"
fi
if selected hyper_floor_contract_429; then
    free_port FLOORC429_PORT
    start_bg "$LOGS/floorc429.log" env WORKERS="$NCPU" FLOOR_CONTRACT=1 FLOOR_QUOTA=1 "$FLOOR" "127.0.0.1:$FLOORC429_PORT" "127.0.0.1:$UP_PORT"
    FLOORC429_PID=$LAST_PID
    wait_port "$FLOORC429_PID" "$FLOORC429_PORT" "hyper floor (contract, 429)" "$LOGS/floorc429.log"
fi
if selected hyper_floor_headers; then
    free_port FLOORH_PORT
    start_bg "$LOGS/floorh.log" env WORKERS="$NCPU" FLOOR_HEADERS=1 "$FLOOR" "127.0.0.1:$FLOORH_PORT" "127.0.0.1:$UP_PORT"
    FLOORH_PID=$LAST_PID
    wait_port "$FLOORH_PID" "$FLOORH_PORT" "hyper floor (headers)" "$LOGS/floorh.log"
fi

# ---- tollgate
declare -A TG_PID=() TG_PORT=()

# tg_config FILE NAME PORT BACKEND QUOTA TRUSTED(0/1) SHARDS(r0|r3|-) [EXTRA LIMIT LINE] [SERVER LINE] [STORE LINE]
#           [ROUTES: one (the default: "/") | prefixes ("/p0000".. ROUTES_N of them) | hosts ("t0.example.com"..)]
tg_config() {
    local file=$1 name=$2 port=$3 backend=$4 quota=$5 trusted=$6 shards=$7 extra=${8:-} server=${9:-} store=${10:-}
    local routes=${11:-one} i
    {
        cat <<EOF
# Generated by benches/load.sh (case $name).
[server]
listen = "127.0.0.1:$port"
shutdown_grace = "1s"
watch_config = false
$server

[log]
level = "warn"

[store]
backend = "$backend"
on_error = "deny"
key_prefix = "load-$name:"
$store
EOF
        if [[ "$shards" == r0 ]]; then
            printf '\n[[store.shards]]\nprimary = "redis://127.0.0.1:%s"\n' "${RPORT[r0]}"
        elif [[ "$shards" == r3 ]]; then
            echo 'read_from = "replica"'
            for i in 1 2 3; do
                printf '\n[[store.shards]]\nprimary = "redis://127.0.0.1:%s"\nreplicas = ["redis://127.0.0.1:%s"]\n' \
                    "${RPORT[s$i]}" "${RPORT[s${i}r]}"
            done
        fi
        if [[ "$trusted" == 1 ]]; then
            printf '\n[identity]\ntrusted_proxies = ["127.0.0.1/32"]\n'
        fi
        cat <<EOF

[[upstreams]]
name = "nginx"
targets = ["http://127.0.0.1:$UP_PORT"]

[[limits]]
name = "core"
window = "1h"
quota = { anonymous = $quota }
$extra
EOF
        case "$routes" in
            one) printf '\n[[routes]]\npath_prefix = "/"\nupstream = "nginx"\nlimits = ["core"]\n' ;;
            # All of one length and in this order: the router keeps config order among them.
            prefixes) awk -v n="$ROUTES_N" 'BEGIN { for (i = 0; i < n; i++)
                printf "\n[[routes]]\npath_prefix = \"/p%04d\"\nupstream = \"nginx\"\nlimits = [\"core\"]\n", i }' ;;
            hosts) awk -v n="$ROUTES_N" 'BEGIN { for (i = 0; i < n; i++)
                printf "\n[[routes]]\nhost = \"t%d.example.com\"\npath_prefix = \"/\"\nupstream = \"nginx\"\nlimits = [\"core\"]\n", i }' ;;
            *) die "tg_config: unknown routes '$routes'" ;;
        esac
    } >"$file"
}

# start_tg NAME BACKEND QUOTA TRUSTED SHARDS [EXTRA] [SERVER] [STORE] [ROUTES]: write, check and start one gateway.
start_tg() {
    local name=$1 port file bin=$TG
    [[ "$name" == tg_memory_plain ]] && bin=$TG_PLAIN
    free_port port
    file="$WORK/tg-$name.toml"
    tg_config "$file" "$name" "$port" "$2" "$3" "$4" "$5" "${6:-}" "${7:-}" "${8:-}" "${9:-}"
    "$bin" check --config "$file" >"$LOGS/check-$name.log" 2>&1 \
        || { cat "$LOGS/check-$name.log" >&2; die "tollgate check rejects the generated $file"; }
    start_bg "$LOGS/tg-$name.log" "$bin" --config "$file"
    TG_PID[$name]=$LAST_PID
    TG_PORT[$name]=$port
    wait_port "$LAST_PID" "$port" "tollgate ($name)" "$LOGS/tg-$name.log"
}

# Does this build know `lease` on a limit? Same config with and without it, through `tollgate check`.
if selected tg_redis_lease; then
    tg_config "$WORK/lease-probe-base.toml" probe 1 redis 1000000000000 0 r0
    tg_config "$WORK/lease-probe.toml" probe 1 redis 1000000000000 0 r0 "lease = 100"
    "$TG" check --config "$WORK/lease-probe-base.toml" >"$LOGS/check-probe-base.log" 2>&1 \
        || { cat "$LOGS/check-probe-base.log" >&2; die "tollgate check rejects the generated base config"; }
    if ! "$TG" check --config "$WORK/lease-probe.toml" >"$LOGS/check-lease.log" 2>&1; then
        log "skipped: lease not supported by this build ($(head -1 "$LOGS/check-lease.log"))"
        LEASE_SKIPPED=1
        drop_case tg_redis_lease
    fi
fi
LEASE_SKIPPED=${LEASE_SKIPPED:-0}

Q=1000000000000
selected tg_memory && start_tg tg_memory memory "$Q" 0 -
selected tg_memory_plain && start_tg tg_memory_plain memory "$Q" 0 -
selected tg_prefixes_10k && start_tg tg_prefixes_10k memory "$Q" 0 - "" "" "" prefixes
selected tg_hosts_10k && start_tg tg_hosts_10k memory "$Q" 0 - "" "" "" hosts
selected tg_memory_w1 && start_tg tg_memory_w1 memory "$Q" 0 - "" "workers = 1"
selected tg_memory_per_core && start_tg tg_memory_per_core memory "$Q" 0 - "" 'runtime = "per_core"'
# Random callers: past the default store.max_callers (a million) within the case on a fast
# machine, where the memory store answers new callers 503 (on_error = "deny").
selected tg_memory_many && start_tg tg_memory_many memory "$Q" 1 - "" "" "max_callers = 100000000"
selected tg_redis && start_tg tg_redis redis "$Q" 0 r0
selected tg_redis_per_core && start_tg tg_redis_per_core redis "$Q" 0 r0 "" 'runtime = "per_core"'
selected tg_redis_many && start_tg tg_redis_many redis "$Q" 1 r0
selected tg_redis3_replicas && start_tg tg_redis3_replicas redis "$Q" 1 r3
selected tg_memory_429 && start_tg tg_memory_429 memory 1 0 -
selected tg_redis_429 && start_tg tg_redis_429 redis 1 0 r0
selected tg_redis_lease && start_tg tg_redis_lease redis "$Q" 0 r0 "lease = 100"
selected tg_redis_64 && start_tg tg_redis_64 redis "$Q" 1 r0
selected tg_redis_64_recent && start_tg tg_redis_64_recent redis "$Q" 1 r0 "" "" 'check_from_charge = "100ms"'

# ---------------------------------------------------------------------------- wrk scripts

# done(): exact percentiles (µs) and counts, on one line that run_once parses.
cat >"$WORK/done.lua" <<'EOF'
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("TGSTATS %d %d %d %d %d %d %d %.1f %.1f %.1f %.1f\n",
    summary.requests, e.status, e.connect, e.read, e.write, e.timeout, summary.duration,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9)))
end
EOF
cp "$WORK/done.lua" "$WORK/one.lua"
# The host of the route a linear scan matches last (tg_hosts_10k, nginx_hosts_10k).
{
    printf 'wrk.headers["Host"] = "%s"\n' "$LAST_HOST"
    cat "$WORK/done.lua"
} >"$WORK/host.lua"
# A random caller per request (16.7 M possible IPs).
{
    cat <<'EOF'
math.randomseed(os.time())
local rnd, fmt = math.random, string.format
request = function()
  return wrk.format(nil, nil, { ["X-Forwarded-For"] = fmt("10.%d.%d.%d", rnd(0, 255), rnd(0, 255), rnd(0, 255)) })
end
EOF
    cat "$WORK/done.lua"
} >"$WORK/many.lua"
# A random one of 64 callers per request.
{
    cat <<'EOF'
math.randomseed(os.time())
local rnd, fmt = math.random, string.format
request = function()
  return wrk.format(nil, nil, { ["X-Forwarded-For"] = fmt("10.0.0.%d", rnd(1, 64)) })
end
EOF
    cat "$WORK/done.lua"
} >"$WORK/few.lua"
# Callers 1..1,000,000 in turn (from the one after `-- OFFSET`), then the last one for ever.
{
    cat <<'EOF'
local n, fmt, floor = 0, string.format, math.floor
init = function(args) n = tonumber(args[1]) or 0 end   -- continue after the callers of a previous run
request = function()
  if n < 1000000 then n = n + 1 end
  return wrk.format(nil, nil, { ["X-Forwarded-For"] = fmt("10.%d.%d.%d", floor(n / 65536) % 256, floor(n / 256) % 256, n % 256) })
end
EOF
    cat "$WORK/done.lua"
} >"$WORK/million.lua"

# ---------------------------------------------------------------------------- cases

declare -A C_URL=() C_SCRIPT=() C_GW=() C_UP=() C_RPIDS=() C_RNODES=() C_EXPECT=() C_HOST=()
R0_NODE="${RPORT[r0]}:p"
def_case() { # NAME URL SCRIPT GW_PIDS UP_PIDS REDIS_PIDS REDIS_NODES EXPECT [HOST (the script sends it too)]
    C_URL[$1]=$2; C_SCRIPT[$1]=$3; C_GW[$1]=$4; C_UP[$1]=$5; C_RPIDS[$1]=$6; C_RNODES[$1]=$7; C_EXPECT[$1]=$8
    C_HOST[$1]=${9:-}
}
def_case direct "http://127.0.0.1:$UP_PORT/" one "" "$UP_PIDS" "" "" 200
def_case nginx_proxy "http://127.0.0.1:$PROXY_PORT/" one "$PROXY_PIDS" "$UP_PIDS" "" "" 200
def_case nginx_lua_redis "http://127.0.0.1:$PROXY_PORT/redis-fw" one "$PROXY_PIDS" "$UP_PIDS" \
    "${RPID[r0]}" "$R0_NODE" 200
def_case nginx_limit_req_429 "http://127.0.0.1:$PROXY_PORT/lr-reject" one "$PROXY_PIDS" "$UP_PIDS" "" "" 429
selected nginx_one_route \
    && def_case nginx_one_route "http://127.0.0.1:$NGINX_ONE_PORT/" one "$ONE_PIDS" "$UP_PIDS" "" "" 200
selected nginx_prefixes_10k \
    && def_case nginx_prefixes_10k "http://127.0.0.1:$NGINX_PFX_PORT$LAST_PREFIX" one "$PFX_PIDS" "$UP_PIDS" "" "" 200
selected nginx_hosts_10k \
    && def_case nginx_hosts_10k "http://127.0.0.1:$NGINX_HOSTS_PORT/" host "$HOSTS_PIDS" "$UP_PIDS" "" "" 200 "$LAST_HOST"
selected tg_prefixes_10k && def_case tg_prefixes_10k "http://127.0.0.1:${TG_PORT[tg_prefixes_10k]}$LAST_PREFIX" one \
    "${TG_PID[tg_prefixes_10k]}" "$UP_PIDS" "" "" 200
selected tg_hosts_10k && def_case tg_hosts_10k "http://127.0.0.1:${TG_PORT[tg_hosts_10k]}/" host \
    "${TG_PID[tg_hosts_10k]}" "$UP_PIDS" "" "" 200 "$LAST_HOST"
selected hyper_floor && def_case hyper_floor "http://127.0.0.1:$FLOOR_PORT/" one "$FLOOR_PID" "$UP_PIDS" "" "" 200
selected hyper_floor_pgo && def_case hyper_floor_pgo "http://127.0.0.1:$FLOORP_PORT/" one "$FLOORP_PID" "$UP_PIDS" "" "" 200
selected hyper_floor_headers && def_case hyper_floor_headers "http://127.0.0.1:$FLOORH_PORT/" one "$FLOORH_PID" "$UP_PIDS" "" "" 200
selected hyper_floor_429 && def_case hyper_floor_429 "http://127.0.0.1:$FLOOR429_PORT/" one "$FLOOR429_PID" "" "" "" 429
selected hyper_floor_429_headers && def_case hyper_floor_429_headers "http://127.0.0.1:$FLOOR429H_PORT/" one "$FLOOR429H_PID" "" "" "" 429
selected hyper_floor_contract && def_case hyper_floor_contract "http://127.0.0.1:$FLOORC_PORT/" one "$FLOORC_PID" "$UP_PIDS" "" "" 200
selected hyper_floor_contract_429 && def_case hyper_floor_contract_429 "http://127.0.0.1:$FLOORC429_PORT/" one "$FLOORC429_PID" "$UP_PIDS" "" "" 429
for c in tg_memory tg_memory_plain tg_memory_w1 tg_memory_per_core tg_memory_many tg_redis tg_redis_per_core tg_redis_many tg_redis3_replicas tg_memory_429 tg_redis_429 tg_redis_lease tg_redis_64 tg_redis_64_recent; do
    selected "$c" || continue
    script=one
    [[ "$c" == *_many || "$c" == tg_redis3_replicas ]] && script=many
    [[ "$c" == tg_redis_64* ]] && script=few
    rp="" rn="" expect=200
    case "$c" in
        tg_redis3_replicas)
            for i in 1 2 3; do
                rp+="${RPID[s$i]} ${RPID[s${i}r]} "
                rn+="${RPORT[s$i]}:p ${RPORT[s${i}r]}:r "
            done ;;
        tg_redis*) rp=${RPID[r0]} rn=$R0_NODE ;;
    esac
    [[ "$c" == *_429 ]] && expect=429
    def_case "$c" "http://127.0.0.1:${TG_PORT[$c]}/" "$script" "${TG_PID[$c]}" "$UP_PIDS" "$rp" "$rn" "$expect"
done

# Spend the quota of 1 of the 429 cases: the first request is admitted, the next is refused
# (for tg_redis_429, that refusal also fills the over-limit cache).
for c in tg_memory_429 tg_redis_429 hyper_floor_contract_429; do
    selected "$c" || continue
    s=$(status "${C_URL[$c]}")
    [[ "$s" == 200 ]] || die "$c: the request that spends the quota got $s, not 200 (see $LOGS)"
done
# nginx_limit_req_429: the first request in the minute passes.
selected nginx_limit_req_429 && status "${C_URL[nginx_limit_req_429]}" >/dev/null
for c in "${SELECTED[@]}"; do
    s=$(status "${C_URL[$c]}" "${C_HOST[$c]}")
    [[ "$s" == "${C_EXPECT[$c]}" ]] || die "$c: smoke request got HTTP $s, expected ${C_EXPECT[$c]} (logs: $LOGS)"
done
# The routes cases route for real: a path no prefix matches and a host no route has get 404 (from
# nginx_hosts_10k's default server), so the 200s above came from the routes.
for c in tg_prefixes_10k nginx_prefixes_10k; do
    selected "$c" || continue
    s=$(status "${C_URL[$c]%"$LAST_PREFIX"}/q0000")
    [[ "$s" == 404 ]] || die "$c: a path no prefix matches got HTTP $s, expected 404 (logs: $LOGS)"
done
for c in tg_hosts_10k nginx_hosts_10k; do
    selected "$c" || continue
    s=$(status "${C_URL[$c]}" "nohost.example.com")
    [[ "$s" == 404 ]] || die "$c: a host no route has got HTTP $s, expected 404 (logs: $LOGS)"
done
log "cases: ${SELECTED[*]}"

# ---------------------------------------------------------------------------- measuring

pid_ticks() { # utime+stime (clock ticks) of the given PIDs, all threads
    local total=0 p rest
    local -a f
    for p in "$@"; do
        [[ -r "/proc/$p/stat" ]] || continue
        rest=$(<"/proc/$p/stat")
        rest=${rest##*) }
        read -r -a f <<<"$rest"
        total=$(( total + f[11] + f[12] ))
    done
    echo "$total"
}
sys_busy_ticks() { awk '/^cpu /{ print $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }

wait_quiet() {
    local t0=$SECONDS b0 b1 pct
    while :; do
        b0=$(sys_busy_ticks); sleep 1; b1=$(sys_busy_ticks)
        pct=$(( (b1 - b0) * 100 / (CLK_TCK * NCPU) ))
        (( pct < QUIET_PCT )) && return 0
        if (( SECONDS - t0 >= QUIET_WAIT )); then
            log "machine still ${pct}% busy after ${QUIET_WAIT}s; measuring anyway"
            return 0
        fi
    done
}

# redis_calls "PORT:ROLE ...": "CALLS SCRIPTS" summed over the nodes (see the header for what counts).
redis_calls() {
    local node port role calls=0 scripts=0 c s
    for node in $1; do
        port=${node%%:*} role=${node##*:}
        read -r c s < <(redis-cli -p "$port" INFO commandstats | awk -v role="$role" -v writes="$WRITE_CMDS" '
            BEGIN { n = split(writes, w, " "); for (i = 1; i <= n; i++) W[tolower(w[i])] = 1 }
            /^cmdstat_/ {
                sub(/\r$/, ""); line = $0; sub(/^cmdstat_/, "", line)
                name = line; sub(/:.*/, "", name); base = name; sub(/\|.*/, "", base)
                if (!match(line, /:calls=[0-9]+/)) next
                c = substr(line, RSTART + 7, RLENGTH - 7) + 0
                if (base == "info" || base == "replconf" || base == "psync" || base == "sync") next
                if (role == "r" && (base in W || base == "multi" || base == "exec" || base == "select" || base == "ping")) next
                calls += c
                if (base ~ /^(eval|evalsha|eval_ro|evalsha_ro|fcall|fcall_ro)$/) scripts += c
            }
            END { printf "%d %d\n", calls, scripts }')
        calls=$(( calls + c )) scripts=$(( scripts + s ))
    done
    echo "$calls $scripts"
}

HTTP_TSV="$WORK/http.tsv"
printf 'case\tround\trps\trequests\tnon2xx\tsock_errors\tp50_ms\tp90_ms\tp99_ms\tp999_ms\tgw_us\tup_us\tredis_us\twrk_us\tbusy_pct\tother_pct\tredis_calls\tredis_scripts\tok\tflag\n' >"$HTTP_TSV"

# run_once CASE ROUND TRY DURATION OUTLINEFILE: one wrk run; its TSV row goes to OUTLINEFILE.
run_once() {
    local c=$1 round=$2 try=$3 dur=$4 lf=$5
    local out="$RAW/wrk-$c-r$round-t$try.txt" tf="$RAW/wrk-$c-r$round-t$try.time"
    local g0 u0 r0 s0 e0 g1 u1 r1 s1 e1 k0=(0 0) k1=(0 0) have_redis=0
    [[ -n "${C_RNODES[$c]}" ]] && have_redis=1
    wait_quiet
    # shellcheck disable=SC2207
    ((have_redis)) && k0=($(redis_calls "${C_RNODES[$c]}"))
    # shellcheck disable=SC2086
    {
        g0=$(pid_ticks ${C_GW[$c]}); u0=$(pid_ticks ${C_UP[$c]}); r0=$(pid_ticks ${C_RPIDS[$c]})
        s0=$(sys_busy_ticks); e0=$(date +%s%N)
    }
    local TIMEFORMAT='%U %S'
    { time timeout -k 5 $(( DUR_S + 60 )) wrk -t1 -c"$CONNS" -d"$dur" --latency \
        -s "$WORK/${C_SCRIPT[$c]}.lua" "${C_URL[$c]}" >"$out" 2>&1; } 2>"$tf" \
        || { cat "$out" >&2; die "wrk failed for $c"; }
    # shellcheck disable=SC2086
    {
        g1=$(pid_ticks ${C_GW[$c]}); u1=$(pid_ticks ${C_UP[$c]}); r1=$(pid_ticks ${C_RPIDS[$c]})
        s1=$(sys_busy_ticks); e1=$(date +%s%N)
    }
    # shellcheck disable=SC2207
    ((have_redis)) && k1=($(redis_calls "${C_RNODES[$c]}"))
    grep -q '^TGSTATS ' "$out" || { cat "$out" >&2; die "no TGSTATS line in the wrk output for $c"; }
    local wu ws
    read -r wu ws <"$tf"
    awk -v c="$c" -v r="$round" -v hz="$CLK_TCK" -v nc="$NCPU" -v hr="$have_redis" \
        -v gt=$(( g1 - g0 )) -v ut=$(( u1 - u0 )) -v rt=$(( r1 - r0 )) -v st=$(( s1 - s0 )) \
        -v el=$(( e1 - e0 )) -v wu="$wu" -v ws="$ws" -v gw="${C_GW[$c]}" -v maxo="$OTHER_MAX" \
        -v kc=$(( k1[0] - k0[0] )) -v ks=$(( k1[1] - k0[1] )) '
        /^Requests\/sec:/ { rps = $2 }
        /^TGSTATS / { q = $2; x = $3; e = $4 + $5 + $6 + $7; p50 = $9; p90 = $10; p99 = $11; p999 = $12 }
        END {
            tick = 1e6 / hz; n = (q > 0 ? q : 1); wcpu = (wu + ws) * 1e6
            busy = st * tick / (el / 1000) / nc * 100
            other = (st * tick - (gt + ut + rt) * tick - wcpu) / (el / 1000) / nc * 100
            if (other < 0) other = 0    # clock-tick rounding of the /proc counters
            printf "%s\t%s\t%.0f\t%d\t%d\t%d\t%.3f\t%.3f\t%.3f\t%.3f\t%s\t%.2f\t%s\t%.2f\t%.1f\t%.1f\t%s\t%s\t%d\t%s\n",
                c, r, rps, q, x, e, p50 / 1000, p90 / 1000, p99 / 1000, p999 / 1000,
                (gw == "" ? "-" : sprintf("%.2f", gt * tick / n)), ut * tick / n,
                (hr ? sprintf("%.2f", rt * tick / n) : "-"), wcpu / n, busy, other,
                (hr ? kc : "-"), (hr ? ks : "-"), q - x, (other > maxo ? "*" : "")
        }' "$out" >"$lf"
}

run_case() { # CASE ROUND
    local c=$1 round=$2 try lf="$WORK/line.tsv" other
    for try in $(seq "$RETRIES"); do
        run_once "$c" "$round" "$try" "$DURATION" "$lf"
        other=$(awk -F'\t' '{ print int($16) }' "$lf")
        (( other <= OTHER_MAX )) && break
        (( try < RETRIES )) && log "$c r$round: ${other}% of the machine went to other processes; repeating"
    done
    cat "$lf" >>"$HTTP_TSV"
    log "$(awk -F'\t' '{ printf "%-20s r%s %8s req/s  p50 %7.3f  p99 %7.3f  p99.9 %7.3f ms  non-2xx %5.1f%%  busy %3.0f%%  other %3.0f%%%s",
        $1, $2, $3, $7, $9, $10, ($4 > 0 ? 100 * $5 / $4 : 0), $15, $16, ($20 == "*" ? "  (contaminated)" : "") }' "$lf")"
}

log "warm-up: $WARMUP per case"
for c in "${SELECTED[@]}"; do
    wrk -t1 -c"$CONNS" -d"$WARMUP" -s "$WORK/${C_SCRIPT[$c]}.lua" "${C_URL[$c]}" >"$RAW/warmup-$c.txt" 2>&1 \
        || { cat "$RAW/warmup-$c.txt" >&2; die "wrk warm-up failed for $c"; }
done
for round in $(seq "$ROUNDS"); do
    log "round $round of $ROUNDS (wrk -t1 -c$CONNS -d$DURATION)"
    for c in "${SELECTED[@]}"; do run_case "$c" "$round"; done
done

# Mean over rounds per case.
SUMMARY="$WORK/summary.tsv"
awk -F'\t' 'NR > 1 {
        c = $1; if (!(c in n)) order[++k] = c
        n[c]++; rps[c] += $3; q[c] += $4; x[c] += $5; e[c] += $6
        p50[c] += $7; p90[c] += $8; p99[c] += $9; p999[c] += $10
        if ($11 != "-") { gw[c] += $11; hgw[c] = 1 }
        up[c] += $12
        if ($13 != "-") { rd[c] += $13; hrd[c] = 1; calls[c] += $17; scr[c] += $18 }
        wk[c] += $14; busy[c] += $15; oth[c] += $16; ok[c] += $19
        if ($20 == "*") flag[c] = "*"
        if (!(c in mn) || $3 < mn[c]) mn[c] = $3
        if (!(c in mx) || $3 > mx[c]) mx[c] = $3
    }
    END {
        print "case\tn\trps\tmin\tmax\tp50\tp90\tp99\tp999\tnon2xx_pct\tsock_errors\tgw_us\tup_us\tredis_us\twrk_us\tbusy\tother\tcalls_per_ok\tcalls_per_req\tscripts_per_ok\tscripts_per_req\tflag"
        for (i = 1; i <= k; i++) {
            c = order[i]; m = n[c]
            printf "%s\t%d\t%.0f\t%.0f\t%.0f\t%.3f\t%.3f\t%.3f\t%.3f\t%.2f\t%d\t%s\t%.2f\t%s\t%.2f\t%.1f\t%.1f\t%s\t%s\t%s\t%s\t%s\n",
                c, m, rps[c] / m, mn[c], mx[c], p50[c] / m, p90[c] / m, p99[c] / m, p999[c] / m,
                (q[c] > 0 ? 100 * x[c] / q[c] : 0), e[c],
                (hgw[c] ? sprintf("%.2f", gw[c] / m) : "-"), up[c] / m,
                (hrd[c] ? sprintf("%.2f", rd[c] / m) : "-"), wk[c] / m, busy[c] / m, oth[c] / m,
                (hrd[c] && ok[c] > 0 ? sprintf("%.3f", calls[c] / ok[c]) : "-"),
                (hrd[c] && q[c] > 0 ? sprintf("%.3f", calls[c] / q[c]) : "-"),
                (hrd[c] && ok[c] > 0 ? sprintf("%.3f", scr[c] / ok[c]) : "-"),
                (hrd[c] && q[c] > 0 ? sprintf("%.3f", scr[c] / q[c]) : "-"), flag[c]
        }
    }' "$HTTP_TSV" >"$SUMMARY"

# val CASE COLUMN: a value from the summary ("" when the case did not run).
val() {
    awk -F'\t' -v c="$1" -v col="$2" 'NR == 1 { for (i = 1; i <= NF; i++) h[$i] = i; next }
        $1 == c { print $(h[col]); exit }' "$SUMMARY"
}

# Latency percentiles for the plot: case, p50, p90, p99, p99.9 (ms), kind.
LAT_TSV="$WORK/latency.tsv"
printf 'case\tp50_ms\tp90_ms\tp99_ms\tp999_ms\tkind\n' >"$LAT_TSV"
awk -F'\t' 'NR > 1 { printf "%s\t%s\t%s\t%s\t%s\tpeak\n", $1, $6, $7, $8, $9 }' "$SUMMARY" >>"$LAT_TSV"

# ---------------------------------------------------------------------------- half load

HALF_TSV="$WORK/halfload.tsv"
HALF_R=""
: >"$HALF_TSV"
if [[ "$SKIP_HALFLOAD" == 1 ]]; then
    log "half-load latency: skipped (SKIP_HALFLOAD=1)"
elif ! selected tg_memory; then
    log "half-load latency: skipped (needs tg_memory's peak rate; tg_memory is not in CASES)"
else
    printf 'case\trate\trequests\tfailed\tnon2xx\tp50\tp90\tp99\tp999\tbusy\tother\tflag\n' >"$HALF_TSV"
    # half_once CASE TRY: one h2load run; its row goes to $WORK/hline.tsv.
    half_once() {
        local c=$1 try=$2 hl="$RAW/h2load-$1-t$2.log" tf="$RAW/h2load-$1-t$2.time"
        local per_client
        per_client=$(awk -v r="$HALF_R" 'BEGIN { printf "%.3f", r / 32 }')
        rm -f "$hl"   # h2load appends to its log file; direct runs once per tollgate case
        local g0 u0 r0 s0 e0 g1 u1 r1 s1 e1 hu hs
        wait_quiet
        # shellcheck disable=SC2086
        {
            g0=$(pid_ticks ${C_GW[$c]}); u0=$(pid_ticks ${C_UP[$c]}); r0=$(pid_ticks ${C_RPIDS[$c]})
            s0=$(sys_busy_ticks); e0=$(date +%s%N)
        }
        local TIMEFORMAT='%U %S'
        { time timeout -k 5 $(( HALF_SECS + 60 )) h2load --h1 -t1 -c32 --rps="$per_client" -D "$HALF_SECS" \
            --log-file="$hl" "${C_URL[$c]}" >"$RAW/h2load-$c-t$try.txt" 2>&1; } 2>"$tf" \
            || { cat "$RAW/h2load-$c-t$try.txt" >&2; die "h2load failed for $c"; }
        # shellcheck disable=SC2086
        {
            g1=$(pid_ticks ${C_GW[$c]}); u1=$(pid_ticks ${C_UP[$c]}); r1=$(pid_ticks ${C_RPIDS[$c]})
            s1=$(sys_busy_ticks); e1=$(date +%s%N)
        }
        read -r hu hs <"$tf"
        sort -t$'\t' -k3,3n "$hl" | awk -F'\t' -v c="$c" -v secs="$HALF_SECS" -v hz="$CLK_TCK" -v nc="$NCPU" \
            -v pt=$(( g1 - g0 + u1 - u0 + r1 - r0 )) -v st=$(( s1 - s0 )) -v el=$(( e1 - e0 )) \
            -v hu="$hu" -v hs="$hs" -v maxo="$OTHER_MAX" '
            $2 == -1 { failed++; next }
            { n++; v[n] = $3; if ($2 < 200 || $2 > 299) bad++ }
            function pct(p,   i) { i = int(p * n + 0.999999); if (i < 1) i = 1; if (i > n) i = n; return v[i] / 1000 }
            END {
                tick = 1e6 / hz
                busy = st * tick / (el / 1000) / nc * 100
                other = (st * tick - pt * tick - (hu + hs) * 1e6) / (el / 1000) / nc * 100
                if (other < 0) other = 0
                if (n == 0) { printf "%s\t0\t0\t%d\t0\t-\t-\t-\t-\t%.1f\t%.1f\t%s\n", c, failed, busy, other, (other > maxo ? "*" : ""); exit }
                printf "%s\t%.0f\t%d\t%d\t%d\t%.3f\t%.3f\t%.3f\t%.3f\t%.1f\t%.1f\t%s\n", c, n / secs, n, failed, bad,
                    pct(0.50), pct(0.90), pct(0.99), pct(0.999), busy, other, (other > maxo ? "*" : "")
            }' >"$WORK/hline.tsv"
    }
    # Each tollgate case at half of its own peak, and direct at that same rate (the row
    # "direct@CASE"), so "p99 added" compares like with like.
    for g in tg_memory tg_redis; do
        selected "$g" || continue
        HALF_R=$(awk -v r="$(val "$g" rps)" 'BEGIN { printf "%.0f", r / 2 }')
        log "half load for $g: h2load --h1 -t1 -c32 at $HALF_R req/s in all, -D $HALF_SECS"
        # The hyper floor at tg_memory's rate too: what hyper alone adds over direct there,
        # the least any hyper-based proxy could add (row "hyper_floor@tg_memory"); and at
        # tg_redis's rate the nginx + Lua + Redis stack, one Redis round trip per request
        # (row "nginx_lua_redis@tg_redis").
        floor_too=""
        [[ "$g" == tg_memory ]] && floor_too=hyper_floor
        [[ "$g" == tg_redis ]] && floor_too=nginx_lua_redis
        for c in direct "$g" $floor_too; do
            selected "$c" || continue
        for try in $(seq "$RETRIES"); do
            half_once "$c" "$try"
            other=$(awk -F'\t' '{ print int($11) }' "$WORK/hline.tsv")
            (( other <= OTHER_MAX )) && break
            (( try < RETRIES )) && log "half load $c: ${other}% of the machine went to other processes; repeating"
        done
        [[ "$c" == direct || "$c" == hyper_floor || "$c" == nginx_lua_redis ]] && sed -i "s/^$c\t/$c@$g\t/" "$WORK/hline.tsv"
        cat "$WORK/hline.tsv" >>"$HALF_TSV"
        log "$(awk -F'\t' '{ printf "half load %-10s %6s req/s  p50 %s  p99 %s  p99.9 %s ms  failed %s  non-2xx %s  busy %.0f%%  other %.0f%%%s", $1, $2, $6, $8, $9, $4, $5, $10, $11, ($12 == "*" ? "  (contaminated)" : "") }' "$WORK/hline.tsv")"
        done
    done
    awk -F'\t' 'NR > 1 && $6 != "-" { printf "%s @ half load\t%s\t%s\t%s\t%s\thalf\n", $1, $6, $7, $8, $9 }' \
        "$HALF_TSV" >>"$LAT_TSV"
fi
half() { # half CASE COLUMN
    [[ -s "$HALF_TSV" ]] || return 0
    awk -F'\t' -v c="$1" -v col="$2" 'NR == 1 { for (i = 1; i <= NF; i++) h[$i] = i; next }
        $1 == c { print $(h[col]); exit }' "$HALF_TSV"
}

# ---------------------------------------------------------------------------- 1M callers

M_RSS="" M_HWM="" M_RSS0="" M_REQ=0 M_NON2XX=0 M_SECS=0 M_RPS="" M_RUNS=0
M_CALLERS=1000000 M_CAP=120
if [[ "$SKIP_1M" == 1 ]]; then
    log "1M callers: skipped (SKIP_1M=1)"
else
    rate=$(val tg_memory_many rps)
    [[ -n "$rate" ]] || rate=$(val tg_memory rps)
    [[ -n "$rate" && "$rate" != 0 ]] || rate=$(( M_CALLERS / M_CAP ))
    start_tg million memory "$Q" 1 -
    M_RSS0=$(awk '/^VmRSS:/ { print $2 }' "/proc/${TG_PID[million]}/status")
    # Run for 1e6 / rate x 1.3 s. Should the machine be slower than measured (other work on
    # the box), top up with more runs that continue from the next caller, 120 s in all at most.
    while :; do
        secs=$(awk -v r="$rate" -v n=$(( M_CALLERS - M_REQ )) -v left=$(( M_CAP - M_SECS )) \
            'BEGIN { s = int(n / r * 1.3 + 0.999); if (s < 5) s = 5; if (s > left) s = left; print s }')
        M_RUNS=$(( M_RUNS + 1 ))
        wait_quiet
        log "1M callers, run $M_RUNS: wrk -t1 -c$CONNS -d${secs}s from caller $(( M_REQ + 1 ))"
        out="$RAW/wrk-million-$M_RUNS.txt"
        timeout -k 5 $(( secs + 60 )) wrk -t1 -c"$CONNS" -d"${secs}s" --latency -s "$WORK/million.lua" \
            "http://127.0.0.1:${TG_PORT[million]}/" -- "$M_REQ" >"$out" 2>&1 \
            || { cat "$out" >&2; die "wrk failed for the 1M-callers run"; }
        read -r req non2xx < <(awk '/^TGSTATS / { print $2, $3 }' "$out")
        M_REQ=$(( M_REQ + req )) M_NON2XX=$(( M_NON2XX + non2xx )) M_SECS=$(( M_SECS + secs ))
        rate=$(( req / secs + 1 ))
        (( M_REQ >= M_CALLERS || M_SECS >= M_CAP )) && break
        log "1M callers: $M_REQ of $M_CALLERS callers after ${M_SECS}s; topping up"
    done
    M_RSS=$(awk '/^VmRSS:/ { print $2 }' "/proc/${TG_PID[million]}/status")
    M_HWM=$(awk '/^VmHWM:/ { print $2 }' "/proc/${TG_PID[million]}/status")
    M_RPS=$(( M_REQ / M_SECS ))
    stop_pid "${TG_PID[million]}"
    log "1M callers: $M_REQ requests in ${M_SECS}s ($M_RPS req/s, $M_NON2XX non-2xx), VmRSS $(( M_RSS / 1024 )) MiB, VmHWM $(( M_HWM / 1024 )) MiB"
fi

# ---------------------------------------------------------------------------- own work

for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
PIDS=()

# own_work_us FILE: criterion's middle estimate (µs) and its range of OWN_BENCH in FILE.
own_work_us() {
    awk -v name="$OWN_BENCH" '
        function us(v, u) {
            if (u == "ps") return v / 1e6; if (u == "ns") return v / 1e3
            if (u == "ms") return v * 1e3; if (u == "s") return v * 1e6
            return v    # µs (or us)
        }
        index($0, name) == 1 { armed = 1 }
        armed && /time:/ {
            line = $0; sub(/.*\[/, "", line); sub(/\].*/, "", line)
            if (split(line, f, /[ \t]+/) < 6) exit
            printf "%.3f %.3f..%.3f\n", us(f[3], f[4]), us(f[1], f[2]), us(f[5], f[6])
            exit
        }' "$1"
}
if [[ "$SKIP_OWNWORK" != 1 ]]; then
    wait_quiet
    log "own work: cargo bench --bench own_work"
    if cargo bench --bench own_work >"$RAW/own-work.txt" 2>&1; then
        read -r OWN_US OWN_RANGE < <(own_work_us "$RAW/own-work.txt") || true
        if [[ -n "$OWN_US" ]]; then
            log "own work: $OWN_US µs per proxied request (criterion's range $OWN_RANGE µs)"
            [[ -n "${TOLLGATE_BIN:-}" ]] && OWN_NOTE="of the working tree at git $(git rev-parse --short HEAD 2>/dev/null || echo unknown), not of TOLLGATE_BIN"
        else
            OWN_NOTE="no estimate of '$OWN_BENCH' in the bench's output ($RAW/own-work.txt)"
            log "own work: $OWN_NOTE"
        fi
    else
        tail -n 20 "$RAW/own-work.txt" >&2
        OWN_NOTE="cargo bench --bench own_work failed (see $RAW/own-work.txt)"
        log "own work: $OWN_NOTE"
    fi
fi

# ---------------------------------------------------------------------------- report

fmt_mb() { awk -v b="$1" 'BEGIN { printf "%.1f MB (%.1f MiB)", b / 1e6, b / 1048576 }'; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 >= b + 0) }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 <= b + 0) }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else print "-" }'; }
# ratio_or_dash A B: A / B, or - when either is missing ("" or -).
ratio_or_dash() {
    if [[ -n "$1" && "$1" != - && -n "$2" && "$2" != - ]]; then ratio "$1" "$2"; else echo -; fi
}
# The routes cases of issue 46 beside their one-route configs: "TOLLGATE_CASE NGINX_CASE WHAT".
ROUTES_ROWS=("tg_memory nginx_one_route one route \"/\", GET /"
    "tg_prefixes_10k nginx_prefixes_10k $ROUTES_TXT prefixes, GET $LAST_PREFIX"
    "tg_hosts_10k nginx_hosts_10k $ROUTES_TXT hosts, Host: $LAST_HOST")

REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || REV+="+dirty"
CMDLINE="DURATION=$DURATION ROUNDS=$ROUNDS"
[[ -n "$CASES" ]] && CMDLINE+=" CASES=\"$CASES\""
for k in SKIP_INSTALL SKIP_BUILD SKIP_HALFLOAD SKIP_1M SKIP_OWNWORK; do [[ "${!k}" == 1 ]] && CMDLINE+=" $k=1"; done
[[ "$PGO" != 1 ]] && CMDLINE+=" PGO=$PGO"
[[ "$HALF_SECS" != 10 ]] && CMDLINE+=" HALF_SECS=$HALF_SECS"
CMDLINE+=" bash benches/load.sh"
ELAPSED=$(( SECONDS - START_TIME ))

targets() {
    local d np nl fl m m_gw np_gw fl_gw r r429 m429 a b ok x
    d=$(val direct rps); np=$(val nginx_proxy rps); nl=$(val nginx_lua_redis rps)
    fl=$(val hyper_floor rps); fl_gw=$(val hyper_floor gw_us)
    m=$(val tg_memory rps); m_gw=$(val tg_memory gw_us); np_gw=$(val nginx_proxy gw_us)
    # row STATUS TARGET MEASURED: one line of the table.
    row() { printf '| **%s** | %s | %s |\n' "$1" "$2" "$3"; }
    times() { awk -v k="$1" -v x="$2" 'BEGIN { print k * x }'; }

    echo "Issue 16 (one run of this script; n/a: a case the target needs did not run):"
    echo
    echo "| result | target | measured |"
    echo "|---|---|---|"
    x="memory store: tg_memory req/s ≥ 1.0× nginx_proxy's, at gateway CPU per request ≤ 1.0× nginx_proxy's"
    if [[ -n "$m" && -n "$np" ]]; then
        ok=FAIL; ge "$m" "$np" && le "$m_gw" "$np_gw" && ok=PASS
        row "$ok" "$x" "$m req/s = $(ratio "$m" "$np")× nginx_proxy; $m_gw µs/req = $(ratio "$m_gw" "$np_gw")× nginx_proxy's $np_gw"
    else row "n/a" "$x" "needs tg_memory and nginx_proxy"; fi

    x="CPU per proxied request (memory store, one limit) ≤ 1.2× the hyper floor's"
    if [[ -n "$m_gw" && -n "$fl_gw" && "$m_gw" != - && "$fl_gw" != - ]]; then
        ok=FAIL; le "$m_gw" "$(times 1.2 "$fl_gw")" && ok=PASS
        local fh_gw fc_gw fp_gw mp_gw
        fp_gw=$(val hyper_floor_pgo gw_us)
        [[ "$fp_gw" == - ]] && fp_gw=""
        mp_gw=$(val tg_memory_plain gw_us)
        [[ "$mp_gw" == - ]] && mp_gw=""
        fh_gw=$(val hyper_floor_headers gw_us)
        [[ "$fh_gw" == - ]] && fh_gw=""
        fc_gw=$(val hyper_floor_contract gw_us)
        [[ "$fc_gw" == - ]] && fc_gw=""
        row "$ok" "$x" "tg_memory $m_gw µs/req = $(ratio "$m_gw" "$fl_gw")× hyper_floor's $fl_gw${fp_gw:+; the floor built profile-guided as tollgate is (hyper_floor_pgo): $fp_gw µs/req, tg_memory = $(ratio "$m_gw" "$fp_gw")× it}${mp_gw:+; tollgate's plain release build, as hyper_floor is built (tg_memory_plain): $mp_gw µs/req = $(ratio "$mp_gw" "$fl_gw")× hyper_floor's}${fh_gw:+; the floor carrying the header lines tollgate adds (hyper_floor_headers): $fh_gw µs/req, tg_memory = $(ratio "$m_gw" "$fh_gw")× it}${fc_gw:+; the floor doing the least work of the contract (hyper_floor_contract): $fc_gw µs/req = $(ratio "$fc_gw" "$fl_gw")× hyper_floor, tg_memory = $(ratio "$m_gw" "$fc_gw")× it}"
    else row "n/a" "$x" "needs tg_memory and hyper_floor"; fi

    r=$(val tg_redis rps)
    x="Redis, 1 shard, after_response: tg_redis req/s ≥ 0.8× nginx_proxy's and ≥ 1.5× nginx_lua_redis's"
    if [[ -n "$r" && -n "$np" && -n "$nl" ]]; then
        ok=FAIL; ge "$r" "$(times 0.8 "$np")" && ge "$r" "$(times 1.5 "$nl")" && ok=PASS
        row "$ok" "$x" "$r req/s = $(ratio "$r" "$np")× nginx_proxy, $(ratio "$r" "$nl")× nginx_lua_redis"
    else row "n/a" "$x" "needs tg_redis, nginx_proxy and nginx_lua_redis"; fi
    rr=$(val tg_redis_64_recent rps); r64=$(val tg_redis_64 rps)
    x="Redis, 1 shard, 64 callers, store.check_from_charge = 100ms (opt-in): tg_redis_64_recent req/s ≥ 0.8× nginx_proxy's and ≥ 1.5× nginx_lua_redis's"
    if [[ -n "$rr" && -n "$np" && -n "$nl" ]]; then
        ok=FAIL; ge "$rr" "$(times 0.8 "$np")" && ge "$rr" "$(times 1.5 "$nl")" && ok=PASS
        row "$ok" "$x" "$rr req/s = $(ratio "$rr" "$np")× nginx_proxy, $(ratio "$rr" "$nl")× nginx_lua_redis${r64:+; without the option (tg_redis_64): $r64 req/s}"
    fi

    m429=$(val tg_memory_429 rps); r429=$(val tg_redis_429 rps)
    x="a 429 (memory store, over-limit cache): tg_memory_429 and tg_redis_429 req/s each ≥ 0.95× direct's"
    if [[ -n "$m429" && -n "$r429" && -n "$d" ]]; then
        ok=FAIL; ge "$m429" "$(times 0.95 "$d")" && ge "$r429" "$(times 0.95 "$d")" && ok=PASS
        f429=$(val hyper_floor_429 rps)
        f429h=$(val hyper_floor_429_headers rps)
        [[ "$f429h" == - ]] && f429h=""
        f429c=$(val hyper_floor_contract_429 rps)
        [[ "$f429c" == - ]] && f429c=""
        row "$ok" "$x" "tg_memory_429 $(ratio "$m429" "$d")×, tg_redis_429 $(ratio "$r429" "$d")× direct${f429:+; the floor, hyper alone answering a fixed 429 (hyper_floor_429): $(ratio "$f429" "$d")× direct, tg_memory_429 = $(ratio "$m429" "$f429")× it}${f429h:+; the floor carrying the header lines and body of the 429 tollgate sends (hyper_floor_429_headers): $(ratio "$f429h" "$d")× direct, tg_memory_429 = $(ratio "$m429" "$f429h")× it}${f429c:+; the floor doing the least work of the contract per refusal (hyper_floor_contract_429): $(ratio "$f429c" "$d")× direct, tg_memory_429 = $(ratio "$m429" "$f429c")× it}"
    else row "n/a" "$x" "needs tg_memory_429, tg_redis_429 and direct"; fi

    a=$(half tg_memory p99); b=$(half tg_redis p99)
    local da db ra rb
    da=$(half direct@tg_memory p99); db=$(half direct@tg_redis p99)
    ra=$(half tg_memory rate); rb=$(half tg_redis rate)
    x="p99 added over direct at half of the case's own peak ≤ 1 ms (tg_memory, tg_redis)"
    if [[ -n "$a" && -n "$b" && -n "$da" && -n "$db" && "$a" != - && "$b" != - ]]; then
        local am bm
        am=$(awk -v x="$a" -v y="$da" 'BEGIN { printf "%.3f", x - y }')
        bm=$(awk -v x="$b" -v y="$db" 'BEGIN { printf "%.3f", x - y }')
        ok=FAIL; le "$am" 1 && le "$bm" 1 && ok=PASS
        local fl fm="" ll lm=""
        fl=$(half hyper_floor@tg_memory p99)
        [[ -n "$fl" && "$fl" != - ]] && fm=$(awk -v x="$fl" -v y="$da" 'BEGIN { printf "%.3f", x - y }')
        ll=$(half nginx_lua_redis@tg_redis p99)
        [[ -n "$ll" && "$ll" != - ]] && lm=$(awk -v x="$ll" -v y="$db" 'BEGIN { printf "%.3f", x - y }')
        row "$ok" "$x" "tg_memory +$am ms (at $ra req/s), tg_redis +$bm ms (at $rb req/s)${fm:+; the hyper floor at the rate of tg_memory: +$fm ms}${lm:+; nginx + Lua + one Redis round trip per request at the rate of tg_redis: +$lm ms}"
    else row "n/a" "$x" "needs the half-load runs of direct, tg_memory and tg_redis"; fi

    x="tollgate's own work for one proxied request, no I/O (criterion, \`benches/own_work.rs\`) ≤ 2 µs"
    if [[ -n "$OWN_US" ]]; then
        ok=FAIL; le "$OWN_US" 2 && ok=PASS
        row "$ok" "$x" "$OWN_US µs (criterion's range $OWN_RANGE µs)${OWN_NOTE:+; $OWN_NOTE}"
    else row "n/a" "$x" "${OWN_NOTE:-not measured}"; fi

    ok=FAIL; le "$BIN_SIZE" 12000000 && ok=PASS
    row "$ok" "release binary ≤ 12 MB (12,000,000 bytes)" "$(fmt_mb "$BIN_SIZE")"

    echo
    echo "Issue 46, routing at scale (gateway CPU per request on the route a linear scan matches last; tg_memory is the one-route config, nginx_one_route its nginx twin):"
    echo
    echo "| result | target | measured |"
    echo "|---|---|---|"
    local spec tc nc what t_gw n_gw np_gw1 r1 r0
    np_gw1=$(val nginx_one_route gw_us)
    for spec in "${ROUTES_ROWS[@]:1}"; do
        read -r tc nc what <<<"$spec"
        t_gw=$(val "$tc" gw_us); n_gw=$(val "$nc" gw_us)
        x="$what: $tc CPU per request ≤ 1.05× tg_memory's, same run"
        if [[ -n "$t_gw" && -n "$m_gw" && "$t_gw" != - && "$m_gw" != - ]]; then
            ok=FAIL; le "$t_gw" "$(times 1.05 "$m_gw")" && ok=PASS
            row "$ok" "$x" "$t_gw µs/req = $(ratio "$t_gw" "$m_gw")× tg_memory's $m_gw"
        else row "n/a" "$x" "needs $tc and tg_memory"; fi
        x="$what: $tc CPU per request ÷ $nc's ≤ tg_memory's ÷ nginx_one_route's (no worse against nginx than with one route)"
        if [[ -n "$t_gw" && -n "$n_gw" && -n "$m_gw" && -n "$np_gw1" && "$t_gw" != - && "$n_gw" != - && "$m_gw" != - && "$np_gw1" != - ]]; then
            r1=$(ratio "$t_gw" "$n_gw"); r0=$(ratio "$m_gw" "$np_gw1")
            # Compared unrounded: t/n <= m/np as t*np <= m*n.
            ok=FAIL; le "$(times "$t_gw" "$np_gw1")" "$(times "$m_gw" "$n_gw")" && ok=PASS
            row "$ok" "$x" "$tc $t_gw ÷ $nc $n_gw = ${r1}×; one route: tg_memory $m_gw ÷ nginx_one_route $np_gw1 = ${r0}×"
        else row "n/a" "$x" "needs $tc, $nc, tg_memory and nginx_one_route"; fi
    done

    echo
    echo "Earlier targets, kept:"
    echo
    echo "| result | target | measured |"
    echo "|---|---|---|"
    # Judged on round trips: the commands clients sent (EVAL*/FCALL script calls), not the
    # commands the scripts run inside Redis, which commandstats counts too (shown beside).
    local parts=() sok=1 any=0 spec cs ss c col scol limit per
    for spec in "tg_redis calls_per_ok scripts_per_ok 1 2xx" "tg_redis_429 calls_per_req scripts_per_req 0.01 request" \
        "tg_redis_lease calls_per_ok scripts_per_ok 0.1 2xx"; do
        read -r c col scol limit per <<<"$spec"
        cs=$(val "$c" "$col"); ss=$(val "$c" "$scol")
        if [[ -n "$cs" && "$cs" != - ]]; then
            any=1
            parts+=("$c $ss round trips (script calls) per $per (target ≤ $limit; $cs commands counted by commandstats, including those run inside the scripts)")
            le "$ss" "$limit" || sok=0
        elif [[ "$c" == tg_redis_lease && "$LEASE_SKIPPED" == 1 ]]; then
            parts+=("tg_redis_lease skipped: lease not supported by this build")
        fi
    done
    x="Redis round trips (script calls): tg_redis ≤ 1 per 2xx, tg_redis_429 ≤ 0.01 per request, tg_redis_lease ≤ 0.1 per 2xx"
    if ((any)); then
        ok=FAIL; ((sok)) && ok=PASS
        local joined
        joined=$(IFS=';'; echo "${parts[*]}")
        row "$ok" "$x" "${joined//;/; }"
    else row "n/a" "$x" "needs tg_redis / tg_redis_429 / tg_redis_lease"; fi

    x="1,000,000 distinct callers: gateway VmRSS ≤ 200 MB"
    if [[ -z "$M_RSS" ]]; then
        row "n/a" "$x" "skipped"
    elif ! le "$(( M_RSS * 1024 ))" 200000000; then
        row FAIL "$x" "$(fmt_mb $(( M_RSS * 1024 ))) after $M_REQ requests"
    elif (( M_REQ < M_CALLERS )); then
        row "n/a" "$x" "only $M_REQ callers reached in ${M_SECS}s; VmRSS $(fmt_mb $(( M_RSS * 1024 )))"
    else
        row PASS "$x" "$(fmt_mb $(( M_RSS * 1024 ))) after $M_REQ requests"
    fi
}

render() {
    local cpu_model
    cpu_model=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
    echo "## Load test: \`benches/load.sh\`"
    echo
    echo "Generated by \`benches/load.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'); everything between the load.sh markers is rewritten by each run."
    echo
    echo "- Machine: $NCPU cores, ${cpu_model:-unknown CPU}, Linux $(uname -r), $(awk '/^MemTotal:/ { printf "%.0f GiB RAM", $2 / 1048576 }' /proc/meminfo)"
    echo "- Command: \`$CMDLINE\` (took ${ELAPSED}s; QUIET_PCT=$QUIET_PCT QUIET_WAIT=$QUIET_WAIT OTHER_MAX=$OTHER_MAX RETRIES=$RETRIES)"
    echo "- tollgate: git $REV, built by $BUILD_KIND; $VERSIONS"
    echo "- Load: \`wrk -t1 -c$CONNS -d$DURATION --latency\`, $WARMUP warm-up per case, $ROUNDS interleaved round(s); wrk, proxies, upstream and Redis all share the $NCPU cores."
    if [[ -n "$CASES" || "$ROUNDS" -lt 2 || "$DUR_S" -lt 10 ]]; then
        echo
        echo "**Partial run** (a CASES subset, one round or DURATION under 10s): a quick try of the harness, not a reference; \`bash benches/load.sh\` with the defaults on a quiet machine is."
    fi
    echo
    echo "### Throughput, latency, CPU"
    echo
    echo "| case | req/s | min..max | × direct | × nginx_proxy | p50 ms | p99 ms | p99.9 ms | non-2xx % | sock err | proxy/gw µs/req | upstream µs/req | redis µs/req | wrk µs/req | busy % | other % | Redis calls/2xx | Redis calls/req | scripts/2xx |"
    echo "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    awk -F'\t' -v d="$(val direct rps)" -v np="$(val nginx_proxy rps)" 'NR > 1 {
        rd = (d > 0 ? sprintf("%.2f", $3 / d) : "-"); rp = (np > 0 ? sprintf("%.2f", $3 / np) : "-")
        printf "| %s%s | %s | %s..%s | %s | %s | %.3f | %.3f | %.3f | %.1f | %s | %s | %.1f | %s | %.1f | %.0f | %.0f | %s | %s | %s |\n",
            $1, $22, $3, $4, $5, rd, rp, $6, $8, $9, $10, $11, ($12 == "-" ? "-" : sprintf("%.1f", $12)), $13,
            ($14 == "-" ? "-" : sprintf("%.1f", $14)), $15, $16, $17, $18, $19, $20 }' "$SUMMARY"
    echo
    echo "Means over the rounds (min..max: req/s of the single rounds). Latency percentiles are wrk's exact ones (Lua \`latency:percentile()\`). CPU is µs of CPU per request from /proc utime+stime (nginx: master + worker; tollgate: all threads; redis: every redis-server of the case; wrk: its rusage). busy % is the whole machine ($NCPU cores = 100 %); other % is the busy share not accounted to those processes (loopback softirq, kernel, anything else running). * = a run still had other % > $OTHER_MAX after $RETRIES tries."
    echo "Redis calls = delta of the summed \`calls=\` of every \`cmdstat_*\` line of \`INFO commandstats\` over all primaries and replicas of the case (not counting our INFO, REPLCONF/PSYNC, and on replicas the replication stream), per 2xx response and per request. Redis counts the commands run inside a Lua script too, so one EVALSHA that runs HMGET counts 2; scripts/2xx counts EVAL/EVALSHA/FCALL alone (round trips of a script-based store)."
    if [[ "$LEASE_SKIPPED" == 1 ]]; then echo; echo "tg_redis_lease: skipped: lease not supported by this build."; fi
    echo
    echo "### tollgate against the hyper floor and nginx"
    echo
    if grep -q $'^tg_' "$SUMMARY"; then
        echo "Each tollgate case as a ratio to \`hyper_floor\` (benches/floor: hyper 1.x alone, one runtime per core, each connection keeping its upstream connection) and to \`nginx_proxy\`: req/s (higher is better) and the gateway's CPU µs per request (lower is better). - : that case did not run."
        echo
        echo "| case | req/s | × hyper_floor | × nginx_proxy | gw CPU µs/req | × hyper_floor's | × nginx_proxy's |"
        echo "|---|--:|--:|--:|--:|--:|--:|"
        awk -F'\t' -v fr="$(val hyper_floor rps)" -v fc="$(val hyper_floor gw_us)" \
            -v nr="$(val nginx_proxy rps)" -v nc="$(val nginx_proxy gw_us)" '
            function r(a, b) { return (b + 0 > 0 && a != "-" && a != "") ? sprintf("%.2f", a / b) : "-" }
            NR > 1 && $1 ~ /^tg_/ {
                printf "| %s%s | %s | %s | %s | %s | %s | %s |\n", $1, $22, $3, r($3, fr), r($3, nr), $12, r($12, fc), r($12, nc)
            }' "$SUMMARY"
    else
        echo "No tollgate case in this run."
    fi
    echo
    echo "### Routing at scale (issue 46)"
    echo
    if selected tg_prefixes_10k || selected tg_hosts_10k || selected nginx_one_route || selected nginx_prefixes_10k || selected nginx_hosts_10k; then
        echo "Each config with its request on the route a linear scan in config order matches last (tollgate: $ROUTES_TXT routes, \`path_prefix = \"/p0000\"\` .. \`\"$LAST_PREFIX\"\`, or \`host = \"t0.example.com\"\` .. \`\"$LAST_HOST\"\` with \`path_prefix = \"/\"\`; nginx: the same prefixes as \`location\`s, the same hosts as the \`server_name\`s of one server beside a 404 default server, found by nginx's server-name hash). × one route: against the first row's case of the same column. tollgate ÷ nginx: the gateway's figure over its nginx twin's in the same row. CPU: µs per request of the proxy process (lower is better). - : that case did not run."
        echo
        echo "| routes, request | tollgate case | gw CPU µs/req | × one route | req/s | × one route | nginx case | nginx CPU µs/req | × one route | req/s | × one route | tollgate ÷ nginx, CPU | tollgate ÷ nginx, req/s |"
        echo "|---|---|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|"
        local spec tc nc what t_gw t_r n_gw n_r
        local m_gw1 m_r1 n_gw1 n_r1
        m_gw1=$(val tg_memory gw_us); m_r1=$(val tg_memory rps); n_gw1=$(val nginx_one_route gw_us); n_r1=$(val nginx_one_route rps)
        for spec in "${ROUTES_ROWS[@]}"; do
            read -r tc nc what <<<"$spec"
            t_gw=$(val "$tc" gw_us); t_r=$(val "$tc" rps); n_gw=$(val "$nc" gw_us); n_r=$(val "$nc" rps)
            printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$what" "$tc$(val "$tc" flag)" \
                "${t_gw:--}" "$(ratio_or_dash "$t_gw" "$m_gw1")" "${t_r:--}" "$(ratio_or_dash "$t_r" "$m_r1")" \
                "$nc$(val "$nc" flag)" "${n_gw:--}" "$(ratio_or_dash "$n_gw" "$n_gw1")" "${n_r:--}" \
                "$(ratio_or_dash "$n_r" "$n_r1")" "$(ratio_or_dash "$t_gw" "$n_gw")" "$(ratio_or_dash "$t_r" "$n_r")"
        done
    else
        echo "Not measured in this run."
    fi
    echo
    echo "### Latency at half load"
    echo
    if [[ -s "$HALF_TSV" ]]; then
        echo "\`h2load --h1 -t1 -c32 --rps=R/32 -D $HALF_SECS\`, R = half of the case's own mean peak req/s; \`direct@CASE\` is the upstream alone at that same R, \`hyper_floor@tg_memory\` the hyper floor at the R of tg_memory, \`nginx_lua_redis@tg_redis\` nginx + Lua with one Redis round trip per request at the R of tg_redis. Percentiles from h2load's per-request log (3rd column, µs to the end of the response); busy/other % as above, with h2load's rusage in place of wrk's. * = other % > $OTHER_MAX after $RETRIES tries."
        echo
        echo "| case | req/s | requests | failed | non-2xx | p50 ms | p90 ms | p99 ms | p99.9 ms | p99 added over direct | busy % | other % |"
        echo "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
        awk -F'\t' 'NR > 1 {
            if ($1 ~ /^direct@/) { d[substr($1, 8)] = $8 }
            base = $1; sub(/^[^@]*@/, "", base)   # hyper_floor@tg_memory: at the rate of tg_memory
            add = ($1 ~ /^direct/ || !(base in d) || $8 == "-") ? "-" : sprintf("%+.3f ms", $8 - d[base])
            printf "| %s%s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.0f | %.0f |\n", $1, $12, $2, $3, $4, $5, $6, $7, $8, $9, add, $10, $11 }' "$HALF_TSV"
    else
        echo "Not measured in this run."
    fi
    echo
    echo "### 1,000,000 distinct callers"
    echo
    if [[ -n "$M_RSS" ]]; then
        local reached="reached"
        (( M_REQ >= 1000000 )) || reached="NOT reached: only $M_REQ callers"
        echo "A fresh memory-store gateway, \`wrk -t1 -c$CONNS\` for ${M_SECS}s in all ($M_RUNS run(s)) with X-Forwarded-For 10.(n>>16&255).(n>>8&255).(n&255), n = 1..1,000,000 then 1,000,000: $M_REQ requests ($M_RPS req/s, $M_NON2XX non-2xx), so 1,000,000 callers $reached."
        echo
        echo "- VmRSS: $(fmt_mb $(( M_RSS * 1024 ))) after (idle before the run: $(fmt_mb $(( M_RSS0 * 1024 ))))"
        echo "- VmHWM: $(fmt_mb $(( M_HWM * 1024 )))"
    else
        echo "Not measured in this run."
    fi
    echo
    echo "### Binary"
    echo
    echo "\`$BIN\`: $BIN_SIZE bytes = $(fmt_mb "$BIN_SIZE")."
    echo
    echo "### Own work (no I/O)"
    echo
    if [[ -n "$OWN_US" ]]; then
        echo "\`cargo bench --bench own_work\`, \`$OWN_BENCH\`: **$OWN_US µs** (criterion's range $OWN_RANGE µs)${OWN_NOTE:+; $OWN_NOTE}. What one iteration covers: the header of benches/own_work.rs."
    else
        echo "Not measured in this run: ${OWN_NOTE:-not run}."
    fi
    echo
    echo "### Targets"
    echo
    targets
    echo
    echo "### Latency percentiles"
    echo
    echo "![latency percentiles per case](benches/latency.svg)"
    echo
    echo "[benches/latency.svg](benches/latency.svg): p50/p90/p99/p99.9 per case (solid: wrk at peak; dashed: h2load at half load), drawn by \`benches/plot.py\`."
}

SECTION="$WORK/section.md"
render >"$SECTION"
python3 benches/plot.py "$LAT_TSV" benches/latency.svg || die "benches/plot.py failed"

BEGIN_MARK='<!-- load.sh:begin -->'
END_MARK='<!-- load.sh:end -->'
# marker_pair: "BEGIN_LINE END_LINE" of the last begin marker that has an end marker after it.
marker_pair() {
    awk -v b="$BEGIN_MARK" -v e="$END_MARK" '{ l[NR] = $0 }
        END { for (i = NR; i >= 1; i--) { if (l[i] == e) ne = i; if (l[i] == b && ne) { print i, ne; exit } } }' BENCHMARKS.md
}
if [[ ! -f BENCHMARKS.md ]]; then
    # shellcheck disable=SC2016
    printf '# tollgate benchmarks\n\nHand-written notes (profiles, analysis) go outside the load.sh markers: `bash benches/load.sh` rewrites only the text between them.\n\n%s\n%s\n' \
        "$BEGIN_MARK" "$END_MARK" >BENCHMARKS.md
elif [[ -z "$(marker_pair)" ]]; then
    printf '\n%s\n%s\n' "$BEGIN_MARK" "$END_MARK" >>BENCHMARKS.md
fi
read -r MB ME < <(marker_pair)
{ head -n "$MB" BENCHMARKS.md; cat "$SECTION"; tail -n +"$ME" BENCHMARKS.md; } >"$WORK/BENCHMARKS.md.new"
cat "$WORK/BENCHMARKS.md.new" >BENCHMARKS.md

echo
cat "$SECTION"
echo
log "wrote BENCHMARKS.md and benches/latency.svg in ${ELAPSED}s"
FAILED=0
