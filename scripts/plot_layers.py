#!/usr/bin/env python3
"""Speedup vs M per pattern, one panel per precision, from `slidesparse-bench layer --json`
files. Standard library only (writes SVG).

usage: python3 scripts/plot_layers.py OUT.svg RUN.json [RUN.json ...]
   e.g. python3 scripts/plot_layers.py docs/layer-speedup.svg \
            docs/results/layer-llama-2026-11-30.json docs/results/layer-qwen-2026-11-30.json
"""
import json
import math
import sys

PATTERNS = ["2:4", "4:6", "6:8", "8:10"]
COLORS = {"2:4": "#1b9e77", "4:6": "#d95f02", "6:8": "#7570b3", "8:10": "#e7298a"}
DASH = ["", "6,4", "2,3"]  # one per model
W, H, PAD = 420, 300, 50


def panel(rows, precision, x0, models):
    ms = sorted({r["m"] for r in rows})
    lo, hi = 0.6, 1.6
    sx = lambda m: x0 + PAD + (math.log2(m) - math.log2(ms[0])) / max(1e-9, math.log2(ms[-1]) - math.log2(ms[0])) * (W - 2 * PAD)
    sy = lambda v: H - PAD - (v - lo) / (hi - lo) * (H - 2 * PAD)
    out = [f'<text x="{x0 + W / 2}" y="20" text-anchor="middle" font-size="14">{precision.upper()}: dense / SlideSparse (whole layer, summed over a block)</text>']
    out.append(f'<rect x="{x0 + PAD}" y="{PAD}" width="{W - 2 * PAD}" height="{H - 2 * PAD}" fill="none" stroke="#999"/>')
    for v in [0.8, 1.0, 1.2, 1.4]:
        out.append(f'<line x1="{x0 + PAD}" x2="{x0 + W - PAD}" y1="{sy(v)}" y2="{sy(v)}" stroke="#ddd" stroke-width="{2 if v == 1.0 else 1}"/>')
        out.append(f'<text x="{x0 + PAD - 5}" y="{sy(v) + 4}" text-anchor="end" font-size="10">{v:.1f}x</text>')
    for m in ms:
        out.append(f'<text x="{sx(m)}" y="{H - PAD + 15}" text-anchor="middle" font-size="10">{m}</text>')
    out.append(f'<text x="{x0 + W / 2}" y="{H - 10}" text-anchor="middle" font-size="11">M (tokens)</text>')
    for mi, model in enumerate(models):
        series = sorted((r for r in rows if r["precision"] == precision and r["model"] == model), key=lambda r: r["m"])
        for p in PATTERNS:
            pts = " ".join(f'{sx(r["m"]):.1f},{sy(r["ms"]["dense"] / r["ms"][p]):.1f}' for r in series if p in r["ms"])
            out.append(f'<polyline points="{pts}" fill="none" stroke="{COLORS[p]}" stroke-width="2" stroke-dasharray="{DASH[mi % 3]}"/>')
    return out


def main():
    path, runs = sys.argv[1], sys.argv[2:]
    rows = [r for f in runs for r in json.load(open(f))["layers"]]
    models = sorted({r["model"] for r in rows})
    precisions = sorted({r["precision"] for r in rows}, key=lambda p: p != "int8")
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * len(precisions)}" height="{H + 40}" font-family="sans-serif">',
           f'<rect width="100%" height="100%" fill="white"/>']
    for i, p in enumerate(precisions):
        svg += panel(rows, p, i * W, models)
    legend = [(p, COLORS[p], "") for p in PATTERNS] + [(m, "#333", DASH[i % 3]) for i, m in enumerate(models)]
    for i, (name, color, dash) in enumerate(legend):
        x = 20 + i * 105
        svg.append(f'<line x1="{x}" x2="{x + 25}" y1="{H + 25}" y2="{H + 25}" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>')
        svg.append(f'<text x="{x + 30}" y="{H + 29}" font-size="11">{name}</text>')
    svg.append("</svg>")
    open(path, "w").write("\n".join(svg))


if __name__ == "__main__":
    main()
