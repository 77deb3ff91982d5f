#!/usr/bin/env bash
# identity.clients_file at scale: N keys (default 1,000,000), one client each (the worst
# case for memory), a label on every 10th. Measures
#   1. `tollgate check` on it: wall time and peak RSS (the load and validation alone);
#   2. the gateway started with it: RSS once serving, and its peak;
#   3. a SIGHUP reload of the keys file: the time the gateway logs for it, the RSS right
#      after it, its peak during it (old and new set both live), and the RSS 2 s later
#      while serving requests (what stays once the old set is gone);
#   4. that a key from the file is served.
# Usage: cargo build --release && bash benches/keys_1m.sh   (TOLLGATE_BIN, N to override)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${TOLLGATE_BIN:-target/release/tollgate}
N=${N:-1000000}
dir=$(mktemp -d)
trap 'kill $pid 2>/dev/null || true; rm -rf "$dir"' EXIT
pid=0
python3 - "$dir/keys.jsonl" "$N" <<'EOF'
import hashlib, sys
path, n = sys.argv[1], int(sys.argv[2])
with open(path, "w") as f:
    for i in range(n):
        h = hashlib.sha256(f"key-{i}".encode()).hexdigest()
        tier = "gold" if i % 10 == 0 else "default"
        label = f', "label": "key {i}"' if i % 10 == 0 else ""
        f.write(f'{{"id": "customer-{i:07d}", "key_sha256": "{h}", "tier": "{tier}"{label}}}\n')
EOF
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
up=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$dir/tollgate.toml" <<EOF
[server]
listen = "127.0.0.1:$port"
watch_config = false
[identity]
clients_file = "keys.jsonl"
[[upstreams]]
name = "api"
targets = ["http://127.0.0.1:$up"]
[[limits]]
name = "core"
window = "1h"
quota = { anonymous = 60, default = 5000, gold = 50000 }
[[routes]]
path_prefix = "/"
upstream = "api"
limits = ["core"]
EOF
echo "keys file: $N lines, $(du -m "$dir/keys.jsonl" | cut -f1) MB"
/usr/bin/time -f "check: %e s wall, %M KB peak RSS" "$BIN" check --config "$dir/tollgate.toml"

echo ok > "$dir/ok"
python3 -m http.server "$up" --bind 127.0.0.1 --directory "$dir" >/dev/null 2>&1 &
http=$!
start=$(date +%s.%N)
"$BIN" --config "$dir/tollgate.toml" 2>"$dir/log" &
pid=$!
until curl -s -o /dev/null "http://127.0.0.1:$port/"; do sleep 0.05; done
ready=$(date +%s.%N)
echo "gateway: serving $(python3 -c "print(round($ready-$start,2))") s after start"
grep -E "VmRSS|VmHWM" /proc/$pid/status | tr -s ' ' | sed 's/^/gateway after start: /'
key=key-12340
code=$(curl -s -o /dev/null -w '%{http_code} %header{x-ratelimit-limit}' -H "Authorization: Bearer $key" "http://127.0.0.1:$port/ok" || true)
echo "request with a key from the file: $code (status, X-RateLimit-Limit)"
kill -HUP $pid
until grep -q "keys file reloaded" "$dir/log"; do sleep 0.05; done
grep "keys file reloaded" "$dir/log" | sed 's/^.*keys file reloaded/reload (SIGHUP):/;s/\x1b\[[0-9;]*m//g'
grep -E "VmRSS|VmHWM" /proc/$pid/status | tr -s ' ' | sed 's/^/gateway right after the reload: /'
# Two seconds of light traffic (20 requests a second), then the RSS again.
for _ in $(seq 40); do
  curl -s -o /dev/null -H "Authorization: Bearer $key" "http://127.0.0.1:$port/ok" || true
  sleep 0.05
done
grep -E "VmRSS" /proc/$pid/status | tr -s ' ' | sed 's/^/gateway 2 s after the reload, serving: /'
kill -HUP $pid
until [ "$(grep -c "keys file reloaded" "$dir/log")" -ge 2 ]; do sleep 0.05; done
sleep 2
curl -s -o /dev/null -H "Authorization: Bearer $key" "http://127.0.0.1:$port/ok" || true
grep -E "VmRSS|VmHWM" /proc/$pid/status | tr -s ' ' | sed 's/^/gateway 2 s after a second reload: /'
kill $pid $http
