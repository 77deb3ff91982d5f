# Sourced by benches/ab.sh and benches/pgo.sh: free loopback ports, one nginx worker as the
# upstream, and a redis-server of their own. The caller sets D (its scratch directory) before sourcing, and stops nginx with
# `kill "$(cat "$D/nginx.pid")"` on exit.

# free_port: a free loopback port (not listened on now, not handed out before).
TAKEN=" "
free_port() {
    local p
    while :; do
        p=$(( 20000 + RANDOM % 12000 ))
        [[ "$TAKEN" == *" $p "* ]] && continue
        [[ -z "$(ss -tanH "sport = :$p")" ]] && { TAKEN+="$p "; echo "$p"; return; }
    done
}

# start_upstream BODY: nginx, one worker, answering every request 200 with BODY (an nginx
# string), keep-alive for a million requests per connection; sets UP to its port.
start_upstream() {
    UP=$(free_port)
    cat >"$D/nginx.conf" <<NG
worker_processes 1;
daemon on;
pid $D/nginx.pid;
error_log $D/nginx-error.log;
events { worker_connections 4096; }
http { access_log off; keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP; location / { return 200 "$1"; } } }
NG
    nginx -c "$D/nginx.conf"
}

# start_redis: a redis-server on a free loopback port, keeping nothing on disk, its log in
# $D/redis.log; sets RP to its port and REDIS_PID to its PID (the caller stops it), and
# returns once it answers PING (at most 5 s).
start_redis() {
    RP=$(free_port)
    redis-server --port "$RP" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$D/redis.log" 2>&1 &
    REDIS_PID=$!
    for _ in $(seq 50); do redis-cli -p "$RP" ping >/dev/null 2>&1 && return; sleep 0.1; done
}
