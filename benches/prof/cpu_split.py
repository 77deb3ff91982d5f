#!/usr/bin/env python3
"""User and system CPU per request of a running server, per process or per thread.

    benches/prof/cpu_split.py NAME PORT PID[,PID...] [SECONDS] [CONNS] [PATH]
    benches/prof/cpu_split.py --threads NAME PORT PID [SECONDS] [CONNS] [PATH]

Runs `wrk -t1 -cCONNS` (default 64) for 2 s to warm up, then for SECONDS (default 10), and
prints req/s, the processes' user and system CPU µs per request (from /proc/PID/task/*/stat,
every thread), their voluntary and involuntary context switches per request, and how busy the
whole machine was. With --threads, one line per thread of the one PID. What BENCHMARKS.md's
"user / sys µs per request" rows use: the kernel's share tells wakeups and system calls from
the process's own work.
"""
import os
import re
import subprocess
import sys

args = sys.argv[1:]
threads = args[:1] == ["--threads"]
if threads:
    args = args[1:]
if len(args) < 3:
    sys.exit(__doc__)
name, port = args[0], args[1]
pids = [int(p) for p in args[2].split(",")]
secs = args[3] if len(args) > 3 else "10"
conns = args[4] if len(args) > 4 else "64"
path = args[5] if len(args) > 5 else "/"
tick = os.sysconf("SC_CLK_TCK")


def snap():
    rows = {}
    for pid in pids:
        for t in os.listdir(f"/proc/{pid}/task"):
            stat = open(f"/proc/{pid}/task/{t}/stat").read()
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            f = stat.rsplit(")", 1)[1].split()
            status = open(f"/proc/{pid}/task/{t}/status").read()
            vcs = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            ivcs = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
            rows[(pid, t)] = (comm, int(f[11]), int(f[12]), vcs, ivcs)
    return rows


def machine():
    v = list(map(int, open("/proc/stat").readline().split()[1:]))
    return sum(v), v[3] + v[4]


url = f"http://127.0.0.1:{port}{path}"
subprocess.run(["wrk", "-t1", f"-c{conns}", "-d2s", url], capture_output=True)
a, m0 = snap(), machine()
out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{secs}s", url], capture_output=True, text=True).stdout
b, m1 = snap(), machine()
reqs = int(re.search(r"(\d+) requests in", out).group(1))
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
busy = 100 * (1 - (m1[1] - m0[1]) / (m1[0] - m0[0]))
per = lambda ticks: ticks * 1e6 / tick / reqs
if threads:
    for k, (comm, u, s, v, iv) in sorted(b.items()):
        if k in a:
            du, ds = per(u - a[k][1]), per(s - a[k][2])
            if du + ds > 0.05:
                print(f"{name} {comm:20s} user {du:6.2f}  sys {ds:6.2f} µs/req  vcs/req {(v - a[k][3]) / reqs:.3f}")
    print(f"{name} req/s {rps:.0f}, machine busy {busy:.0f}%")
else:
    d = [sum(b[k][i] - a[k][i] for k in b if k in a) for i in (1, 2, 3, 4)]
    print(
        f"{name:14s} req/s {rps:9.0f}  user {per(d[0]):6.2f}  sys {per(d[1]):6.2f}  total {per(d[0] + d[1]):6.2f} µs/req"
        f"  vcs/req {d[2] / reqs:.3f}  ivcs/req {d[3] / reqs:.3f}  busy {busy:.0f}%"
    )
