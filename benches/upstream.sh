# Sourced by benches/ab.sh and benches/pgo.sh: free loopback ports and one nginx worker as the
# upstream. The caller sets D (its scratch directory) before sourcing, and stops nginx with
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
