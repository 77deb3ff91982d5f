#!/usr/bin/env bash
# `tollgate replay` speed (issue 19 target: 10,000,000 lines in <= 30 s): generates an
# hour of tollgate text access lines (N, default 10,000,000; ~3.3 GB, removed at exit)
# from 1,000 clients (keys file) and 100,000 anonymous addresses over two routes and
# three limits (fixed window, sliding log, GCRA), then times one replay of it and
# reports its peak RSS.
# Usage: cargo build --release && bash benches/replay.sh   (TOLLGATE_BIN, N to override;
# KEEP=1 keeps the generated directory)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TOLLGATE_BIN:-target/release/tollgate}
N=${N:-10000000}
dir=$(mktemp -d)
[ -n "${KEEP:-}" ] || trap 'rm -rf "$dir"' EXIT; echo "dir: $dir"
python3 - "$dir" "$N" <<'EOF'
import hashlib, sys
d, n = sys.argv[1], int(sys.argv[2])
with open(f"{d}/keys.jsonl", "w") as f:
    for i in range(1000):
        h = hashlib.sha256(f"key-{i}".encode()).hexdigest()
        tier = "gold" if i % 10 == 0 else "default"
        f.write(f'{{"id": "customer-{i:04d}", "key_sha256": "{h}", "tier": "{tier}"}}\n')
# 2026-11-24T10:00:00Z, one hour: lines in the order responses ended.
t0 = 1795514400000
step = 3_600_000 / n
import time
def ts(ms):
    s, ms = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s)) + f".{ms:03d}000Z"
with open(f"{d}/access.log", "w", buffering=1 << 20) as f:
    out = []
    sec_cache = {}
    for i in range(n):
        end = t0 + int(i * step)
        s, ms = divmod(end, 1000)
        base = sec_cache.get(s)
        if base is None:
            sec_cache.clear()
            base = sec_cache[s] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(s))
        if i % 3:
            caller, tier = f"customer-{(i * 7919) % 1000:04d}", "default"
        else:
            caller, tier = "anonymous", "anonymous"
        path = "/search" if i % 5 == 0 else f"/v1/items/{i % 97}"
        out.append(
            f'{base}.{ms:03d}412Z  INFO tollgate::access: request method=GET path="{path}" route="/" '
            f'status=200 client="{(i * 104729) % 100000:032x}" caller="{caller}" tier="{tier}" key="-" '
            f'decision="allowed" limit="core" remaining=42 cost=1 upstream_ms=1.234 total_ms=1.5 '
            f'request_id="0f3c2a4e-5b6d-4e7f-0000-{i:012x}"\n'
        )
        if len(out) == 10000:
            f.write("".join(out))
            out.clear()
    f.write("".join(out))
EOF
cat > "$dir/tollgate.toml" <<EOF
[server]
listen = "127.0.0.1:8080"
[identity]
clients_file = "keys.jsonl"
[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:9000"]
[[limits]]
name = "core"
window = "1m"
quota = { anonymous = 30, default = 600, gold = 3000 }
[[limits]]
name = "search"
algorithm = "sliding_log"
window = "1m"
quota = { anonymous = 5, default = 100, gold = 500 }
[[limits]]
name = "burst"
algorithm = "gcra"
window = "10s"
quota = { anonymous = 10, default = 200, gold = 1000 }
[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core", "burst"]
[[routes]]
path_prefix = "/search"
upstream = "api"
limits = ["core", "search"]
EOF
echo "log: $(wc -l < "$dir/access.log") lines, $(du -h "$dir/access.log" | cut -f1)"
# Read once so that the timed run reads from the page cache, as a second replay would.
cat "$dir/access.log" > /dev/null
start=$(date +%s.%N)
/usr/bin/time -f "peak RSS %M KB, user %U s, sys %S s" "$BIN" replay --config "$dir/tollgate.toml" "$dir/access.log" > "$dir/report.txt"
end=$(date +%s.%N)
head -60 "$dir/report.txt"
echo "replay of $N lines: $(echo "$end - $start" | bc) s"
