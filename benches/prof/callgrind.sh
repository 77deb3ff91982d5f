#!/usr/bin/env bash
# Instructions per request of a running server, counted by callgrind (deterministic, unlike
# the wall clock of a shared VM): what BENCHMARKS.md's "instructions per request" rows use.
#
#   benches/prof/callgrind.sh NAME PORT CMD...
#   CONNS=64 benches/prof/callgrind.sh tg 18092 target/profiling/tollgate run --config my.toml
#   WORKERS=1 benches/prof/callgrind.sh floor 18091 benches/floor/target/release/tollgate-floor 127.0.0.1:18091 127.0.0.1:18080
#
# Starts CMD under `valgrind --tool=callgrind` (serve one worker: `[server] workers = 1`, or
# WORKERS=1 for the floor), waits until http://127.0.0.1:PORT/ answers, warms up with
# `wrk -t1 -cCONNS -d3s`, zeroes the counters, runs `wrk -t1 -cCONNS -d5s`, dumps, stops CMD,
# and prints the instructions of the whole process divided by the requests wrk counted.
# The profile is left in ./cg.NAME.out.1 (read it with callgrind_annotate) and the request
# count in ./cg.NAME.reqs. Needs valgrind (callgrind_control) and wrk. CONNS defaults to 4.
#
# CACHE=1 also simulates the caches and branch predictors (`--cache-sim=yes --branch-sim=yes`,
# the host's L1/LL sizes) and prints per request the L1 instruction misses (I1mr), the L1
# data read and write misses (D1mr, D1mw) and the mispredicted conditional and indirect
# branches (Bcm, Bim). INSTR=1 records costs per instruction (`--dump-instr=yes`), which
# benches/prof/footprint.py reads: how many 64-byte lines of code a request executes.
set -euo pipefail
[[ $# -ge 3 ]] || { sed -n '2,23p' "$0" >&2; exit 2; }
extra=()
[[ "${CACHE:-0}" == 1 ]] && extra+=(--cache-sim=yes --branch-sim=yes)
dump_instr=no
[[ "${INSTR:-0}" == 1 ]] && dump_instr=yes
name=$1 port=$2
shift 2
conns=${CONNS:-4}
rm -f "cg.$name.out" "cg.$name.out".*
valgrind --tool=callgrind --callgrind-out-file="$PWD/cg.$name.out" --dump-instr=$dump_instr ${extra[@]+"${extra[@]}"} "$@" >"cg.$name.log" 2>&1 &
vp=$!
trap 'kill "$vp" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    curl -s -o /dev/null "http://127.0.0.1:$port/" && break
    sleep 0.3
done
wrk -t1 "-c$conns" -d3s "http://127.0.0.1:$port/" >/dev/null
callgrind_control -z "$vp" >/dev/null 2>&1
out=$(wrk -t1 "-c$conns" -d5s "http://127.0.0.1:$port/")
callgrind_control -d "$vp" >/dev/null 2>&1
sleep 1
kill "$vp"
wait "$vp" 2>/dev/null || true
reqs=$(grep -o '[0-9]* requests in' <<<"$out" | cut -d' ' -f1)
total=$(callgrind_annotate "cg.$name.out.1" 2>/dev/null | grep -m1 'PROGRAM TOTALS' | tr -d ',' | awk '{ print $1 }')
echo "$reqs" >"cg.$name.reqs"
echo "$name: $reqs requests, $total instructions, $((total / reqs)) per request (cg.$name.out.1)"
if [[ "${CACHE:-0}" == 1 ]]; then
    callgrind_annotate "cg.$name.out.1" 2>/dev/null | grep -m1 'PROGRAM TOTALS' | tr -d ',' \
        | awk -v r="$reqs" '{ printf "per request: I1mr %.0f  D1mr %.0f  D1mw %.0f  Bcm %.0f  Bim %.0f\n", $7 / r, $9 / r, $11 / r, $21 / r, $25 / r }'
fi
