#!/usr/bin/env python3
"""benches/plot.py RESULTS.tsv OUT.svg: latency percentiles per case, as a hand-written SVG.

RESULTS.tsv is written by benches/load.sh: a header line, then one row per series with the
columns case, p50_ms, p90_ms, p99_ms, p999_ms and kind ("peak" for wrk at full load, "half"
for h2load at half load; half-load series are drawn dashed, in the colour of their case).

The x axis is a log-scale percentile axis (position = log10(1 / (1 - p)), so p50, p90, p99 and
p99.9 are ~evenly spaced), the y axis is milliseconds on a log scale. Python 3 stdlib only.
"""

import csv
import math
import sys
from xml.sax.saxutils import escape

PERCENTILES = [(0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (0.999, "p99.9")]
COLUMNS = ["p50_ms", "p90_ms", "p99_ms", "p999_ms"]
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
    "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939",
    "#843c39", "#7b4173", "#3182bd", "#e6550d",
]

WIDTH, HEIGHT = 980, 560
LEFT, RIGHT, TOP, BOTTOM = 80, 300, 50, 70


def read_series(path):
    series = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            values = []
            for col in COLUMNS:
                try:
                    v = float(row.get(col, ""))
                except ValueError:
                    v = None
                values.append(v if v is not None and v > 0 else None)
            if any(v is not None for v in values):
                series.append({"name": row["case"], "kind": row.get("kind", "peak"), "values": values})
    return series


def x_pos(p):
    return math.log10(1.0 / (1.0 - p))


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot.py RESULTS.tsv OUT.svg")
    series = read_series(sys.argv[1])
    if not series:
        sys.exit("plot.py: no latency data in " + sys.argv[1])

    all_values = [v for s in series for v in s["values"] if v is not None]
    y_lo = math.floor(math.log10(min(all_values)))
    y_hi = math.ceil(math.log10(max(all_values)))
    if y_hi == y_lo:
        y_hi += 1
    x_lo, x_hi = x_pos(0.5) - 0.15, x_pos(0.999) + 0.15
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(p):
        return LEFT + (x_pos(p) - x_lo) / (x_hi - x_lo) * pw

    def sy(ms):
        return TOP + ph - (math.log10(ms) - y_lo) / (y_hi - y_lo) * ph

    # One colour per case; a half-load series takes the colour of its case.
    colours = {}
    for s in series:
        base = s["name"].split(" @ ")[0]
        if base not in colours:
            colours[base] = PALETTE[len(colours) % len(PALETTE)]
        s["colour"] = colours[base]

    out = []
    w = out.append
    w('<?xml version="1.0" encoding="UTF-8"?>')
    w(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
      f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">')
    w(f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>')
    w(f'<text x="{LEFT + pw / 2:.1f}" y="26" text-anchor="middle" font-size="16">'
      'tollgate load test: latency percentiles per case</text>')

    # Y grid: decades labelled, 2x and 5x light.
    for d in range(y_lo, y_hi + 1):
        for m in (1, 2, 5):
            v = m * 10.0 ** d
            if math.log10(v) > y_hi + 1e-9:
                continue
            y = sy(v)
            strong = m == 1
            w(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + pw}" y2="{y:.1f}" '
              f'stroke="{"#bbbbbb" if strong else "#e6e6e6"}" stroke-width="1"/>')
            label = f"{v:g}"
            w(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end" '
              f'fill="{"#222222" if strong else "#888888"}">{label}</text>')
    # X grid at the percentiles.
    for p, label in PERCENTILES:
        x = sx(p)
        w(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + ph}" stroke="#dddddd" stroke-width="1"/>')
        w(f'<text x="{x:.1f}" y="{TOP + ph + 18}" text-anchor="middle">{label}</text>')
    w(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444444"/>')
    w(f'<text x="{LEFT + pw / 2:.1f}" y="{HEIGHT - 22}" text-anchor="middle">'
      'percentile (log scale of 1 / (1 - p))</text>')
    w(f'<text x="20" y="{TOP + ph / 2:.1f}" text-anchor="middle" '
      f'transform="rotate(-90 20 {TOP + ph / 2:.1f})">latency, ms (log scale)</text>')

    # Series.
    for s in series:
        pts = [(sx(p), sy(v)) for (p, _), v in zip(PERCENTILES, s["values"]) if v is not None]
        dash = ' stroke-dasharray="6 4"' if s["kind"] == "half" else ""
        title = escape(s["name"]) + ": " + ", ".join(
            f"{label} {v:.3f} ms" for (_, label), v in zip(PERCENTILES, s["values"]) if v is not None)
        w(f'<g><title>{title}</title>')
        if len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            w(f'<polyline points="{path}" fill="none" stroke="{s["colour"]}" stroke-width="2"{dash}/>')
        for x, y in pts:
            w(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{s["colour"]}"/>')
        w('</g>')

    # Legend.
    lx, ly = LEFT + pw + 24, TOP + 6
    w(f'<text x="{lx}" y="{ly}" font-weight="bold">case (solid: wrk at peak;</text>')
    w(f'<text x="{lx}" y="{ly + 15}" font-weight="bold">dashed: h2load at half load)</text>')
    for i, s in enumerate(series):
        y = ly + 36 + i * 18
        dash = ' stroke-dasharray="6 4"' if s["kind"] == "half" else ""
        w(f'<line x1="{lx}" y1="{y - 4}" x2="{lx + 28}" y2="{y - 4}" stroke="{s["colour"]}" '
          f'stroke-width="2"{dash}/>')
        w(f'<text x="{lx + 36}" y="{y}">{escape(s["name"])}</text>')
    w('</svg>')

    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
