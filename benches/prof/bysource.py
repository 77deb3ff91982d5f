#!/usr/bin/env python3
"""Instructions per request by the source each instruction's line comes from.

    benches/prof/bysource.py NAME [NAME...]

Reads the profiles benches/prof/callgrind.sh left in the current directory (cg.NAME.out.1
and cg.NAME.reqs) and prints, per source, the instructions one request executes there, one
column per profile: a library crate (from its path under ~/.cargo/registry), Rust's std,
core and alloc, tollgate's own files by top-level module (`tollgate: proxy`), the floor
(benches/floor), memcpy and the rest of libc by file. A line's cost counts where the code
was written, not where it was inlined, so two binaries compare by what they run, not by how
the compiler cut it into functions. Needs line tables: tollgate's `--profile profiling`,
and the floor built with `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only`. BENCHMARKS.md,
issue 16, sixteenth round, uses it to compare tollgate with the contract floor.
"""
import collections
import re
import sys

from cgout import Names


def load(name):
    reqs = int(open(f"cg.{name}.reqs").read())
    resolve = Names().resolve
    fl = fi = None
    after_call = False
    cost = collections.Counter()

    for raw in open(f"cg.{name}.out.1", errors="replace"):
        line = raw.rstrip("\n")
        if not line:
            continue
        if line.startswith("fl="):
            fl, fi = resolve(line[3:]), None
        elif line.startswith(("fi=", "fe=")):
            fi = resolve(line[3:])
        elif line.startswith(("cfi=", "cfl=")):
            resolve(line[4:])
        elif line.startswith("calls="):
            # The next cost line is the call's inclusive cost, not this line's own.
            after_call = True
        elif line[0] in "0123456789+-*":
            if after_call:
                after_call = False
            else:
                cost[fi or fl] += int(line.split()[-1])
    return reqs, cost


def source(path):
    m = re.search(r"index\.crates\.io-[0-9a-f]+/([A-Za-z_\-]+?)-\d", path)
    if m:
        return m.group(1)
    if "/rustc/" in path or "/rust/deps/" in path:
        return "std/core/alloc"
    if "benches/floor/" in path:
        return "floor"
    m = re.search(r"(?:^|/)src/([^/]+)", path)
    if m:
        return "tollgate: " + m.group(1)
    if "memmove" in path or "memcpy" in path:
        return "memcpy"
    return "other: " + path.rsplit("/", 1)[-1]


if len(sys.argv) < 2:
    sys.exit(__doc__)
names = sys.argv[1:]
data = {}
for n in names:
    reqs, cost = load(n)
    by = collections.Counter()
    for path, c in cost.items():
        by[source(path)] += c
    data[n] = (reqs, by)
rows = sorted(set().union(*(d[1] for d in data.values())),
              key=lambda k: -max(data[n][1][k] / data[n][0] for n in names))
print("%-32s" % "source" + "".join("%10s" % n for n in names))
for k in rows[:40]:
    print("%-32s" % k[:32] + "".join("%10.0f" % (data[n][1][k] / data[n][0]) for n in names))
print("%-32s" % "TOTAL" + "".join("%10.0f" % (sum(data[n][1].values()) / data[n][0]) for n in names))
