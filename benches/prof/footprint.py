#!/usr/bin/env python3
"""The code a request executes, in 64-byte lines (what the L1 instruction cache holds).

    INSTR=1 benches/prof/callgrind.sh NAME PORT CMD...   # writes cg.NAME.out.1, cg.NAME.reqs
    benches/prof/footprint.py NAME [TOP] [FUNCTION_REGEX]

Reads the callgrind profile recorded with `--dump-instr=yes` (INSTR=1) and the request count
callgrind.sh left in the current directory, and prints: how many distinct lines of code ran at all, how
many ran at least once every other request (a request's hot code), their size in KiB and
how densely the hot instructions fill them (a line half filled with code that never runs
costs the cache as much as a full one), then the TOP functions (default 25) with the most
hot lines. With FUNCTION_REGEX, only functions whose name matches it are counted.

A line's executions per request is the largest execution count of its instructions divided
by the requests. An instruction's size is the distance to the next recorded instruction
(at most 15 bytes, x86's longest). BENCHMARKS.md, issue 16, fifteenth round, uses it to
compare tollgate's code per request with the hyper floor's.
"""
import collections
import re
import sys

from cgout import Names

if len(sys.argv) < 2:
    sys.exit(__doc__)
name = sys.argv[1]
top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
only = re.compile(sys.argv[3]) if len(sys.argv) > 3 else None
reqs = int(open(f"cg.{name}.reqs").read())

resolve = Names().resolve


executions = {}  # instruction address -> (largest execution count, function)
fn = None
addr = 0
after_calls = False
for raw in open(f"cg.{name}.out.1", errors="replace"):
    line = raw.rstrip("\n")
    if not line:
        continue
    if line.startswith("fn="):
        fn = resolve(line[3:])
        continue
    if line.startswith("cfn="):
        resolve(line[4:])
        continue
    if line.startswith("calls="):
        # The next cost line is the call's inclusive cost, not this instruction's own.
        after_calls = True
        continue
    if line[0] not in "0123456789+-*":
        continue
    fields = line.split()
    pos = fields[0]
    if pos.startswith("0x"):
        addr = int(pos, 16)
    elif pos[0] == "+":
        addr += int(pos[1:])
    elif pos[0] == "-":
        addr -= int(pos[1:])
    if after_calls:
        after_calls = False
        continue
    if len(fields) < 3 or fn is None or (only and not only.search(fn)):
        continue
    count = int(fields[2])
    if count > executions.get(addr, (0, None))[0]:
        executions[addr] = (count, fn)

addrs = sorted(executions)
all_lines = {a >> 6 for a in addrs}
hot_bytes = collections.Counter()
line_fn = {}
for i, a in enumerate(addrs):
    count, f = executions[a]
    if count / reqs < 0.5:
        continue
    size = min(addrs[i + 1] - a, 15) if i + 1 < len(addrs) else 4
    hot_bytes[a >> 6] += size
    line_fn.setdefault(a >> 6, f)
hot = len(hot_bytes)
density = sum(hot_bytes.values()) / (64 * hot) if hot else 0
print(
    f"{name}: {len(all_lines)} lines of code ran, {hot} at least every other request "
    f"({hot * 64 / 1024:.1f} KiB, {density:.0%} of their bytes hot), {reqs} requests"
)
for f, n in collections.Counter(line_fn.values()).most_common(top):
    print(f"{n:6d}  {f[:160]}")
