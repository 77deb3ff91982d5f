#!/usr/bin/env python3
"""What Redis spends per call of two versions of lua/apply.lua, fixed-window CHARGEs.

    benches/prof/script_cost.py OLD.lua NEW.lua KEYS CALLS ROUNDS [PORT]

    git show HEAD~1:lua/apply.lua >/tmp/old.lua
    redis-server --port 16390 --save '' --daemonize yes
    python3 benches/prof/script_cost.py /tmp/old.lua lua/apply.lua 6 20000 3 16390

Loads both scripts into the redis-server on 127.0.0.1:PORT (default 16390; it is FLUSHALLed:
never point it at a server that holds anything), then, ROUNDS times and the two versions in
turn: FLUSHALL, CONFIG RESETSTAT, CALLS pipelined EVALSHAs each charging 1 unit to KEYS
fixed windows (the gateway's packed arguments), and reads `usec_per_call` of
`cmdstat_evalsha` from INFO commandstats: Redis's own time per call, without the network or
the client. Prints each version's rounds, sorted, in µs. Standard library only (RESP by hand).
"""
import socket
import struct
import sys
import time


class Conn:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    @staticmethod
    def encode(*args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def read(self):
        line = self.file.readline()
        kind = line[:1]
        if kind == b"-":
            raise RuntimeError(line.decode().strip())
        if kind in b"+:":
            return line[1:-2]
        if kind == b"$":
            n = int(line[1:])
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(int(line[1:]))]
        raise RuntimeError(f"unexpected reply {line!r}")

    def call(self, *args):
        self.sock.sendall(self.encode(*args))
        return self.read()


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    old, new, keys, calls, rounds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    conn = Conn(int(sys.argv[6]) if len(sys.argv) > 6 else 16390)
    shas = {v: conn.call("SCRIPT", "LOAD", open(p).read()).decode() for v, p in (("old", old), ("new", new))}
    names = [f"script_cost:{i}" for i in range(keys)]
    per_call = {"old": [], "new": []}
    for _ in range(rounds):
        for version, sha in shas.items():
            conn.call("FLUSHALL")
            conn.call("CONFIG", "RESETSTAT")
            now = int(time.time() * 1000)
            # op CHARGE, fixed window, quota, window ms, burst, align, cost, now ms, id
            args = struct.pack("<10Q", 1, 0, 10**15, 3_600_000, 10**15, 0, 0, 1, now, 0) * keys
            one = conn.encode("EVALSHA", sha, keys, *names, args)
            batch = 500
            for sent in range(0, calls, batch):
                n = min(batch, calls - sent)
                conn.sock.sendall(one * n)
                for _ in range(n):
                    conn.read()
            stats = conn.call("INFO", "commandstats").decode()
            line = next(l for l in stats.split("\r\n") if l.startswith("cmdstat_evalsha:"))
            per_call[version].append(float(line.split("usec_per_call=")[1].split(",")[0]))
    for version, v in per_call.items():
        print(f"{version} ({old if version == 'old' else new}), {keys} keys a call: "
              + ", ".join(f"{x:.2f}" for x in sorted(v)) + " µs per call")


if __name__ == "__main__":
    main()
