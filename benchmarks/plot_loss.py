"""Draws benchmarks.fp8_loss's two curves as an SVG (no plotting library needed): the per-step losses, thin, and
their 20-step running means over them, bf16 and FP8, with the verdict in the title.

    python -m benchmarks.plot_loss /tmp/fp8_loss/fp8_loss.json --out docs/fp8_loss.svg
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

W, H, PAD = 720, 420, 56
COLOURS = {"bf16": "#1f77b4", "fp8": "#d62728"}


def running_mean(y, n: int = 20):
    y = np.asarray(y, float)
    c = np.cumsum(np.insert(y, 0, 0.0))
    return np.array([(c[i + 1] - c[max(0, i + 1 - n)]) / min(i + 1, n) for i in range(len(y))])


def svg(result: dict) -> str:
    curves = {k: np.asarray(result[k]["loss"], float) for k in COLOURS}
    steps = max(len(c) for c in curves.values())
    skip = min(10, steps - 1)  # the first steps' losses (log of the vocabulary) would squash the rest
    lo = min(c[skip:].min() for c in curves.values())
    hi = max(c[skip:].max() for c in curves.values())
    hi = hi if hi > lo else lo + 1.0

    def xy(i, v):
        return PAD + (W - 2 * PAD) * i / max(steps - 1, 1), H - PAD - (H - 2 * PAD) * (min(v, hi) - lo) / (hi - lo)

    def line(ys, colour, width, opacity):
        pts = " ".join("%.1f,%.1f" % xy(i, v) for i, v in enumerate(ys) if i >= skip)
        return f'<polyline fill="none" stroke="{colour}" stroke-width="{width}" stroke-opacity="{opacity}" points="{pts}"/>'

    v = result.get("verdict", {})
    title = (f"{result.get('preset', '')} seq {result.get('seq')} batch {result.get('batch')}: final loss bf16 "
             f"{v.get('final_bf16', float('nan')):.4f}, FP8 ({result.get('fp8_format')}) "
             f"{v.get('final_fp8', float('nan')):.4f} ({100 * v.get('final_rel', float('nan')):+.2f}%)")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle">{title}</text>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
           f'<text x="{W / 2}" y="{H - 14}" text-anchor="middle">step</text>',
           f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">loss</text>']
    for t in np.linspace(0, steps - 1, 6):
        x, _ = xy(t, lo)
        out.append(f'<text x="{x:.1f}" y="{H - PAD + 16}" text-anchor="middle">{int(round(t)) + 1}</text>')
    for t in np.linspace(lo, hi, 6):
        _, y = xy(0, t)
        out.append(f'<text x="{PAD - 6}" y="{y + 4:.1f}" text-anchor="end">{t:.2f}</text>')
    for k, colour in COLOURS.items():
        out.append(line(curves[k], colour, 0.6, 0.35))
        out.append(line(running_mean(curves[k]), colour, 1.8, 1.0))
    for n, (k, colour) in enumerate(COLOURS.items()):
        out.append(f'<text x="{W - PAD - 150}" y="{PAD + 16 * n}" fill="{colour}">{k} (20-step mean, bold)</text>')
    return "\n".join(out + ["</svg>"]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="fp8_loss.json from benchmarks.fp8_loss")
    p.add_argument("--out", default="docs/fp8_loss.svg", help="the SVG to write (default: docs/fp8_loss.svg)")
    a = p.parse_args(argv)
    with open(a.result) as f:
        result = json.load(f)
    with open(a.out, "w") as f:
        f.write(svg(result))
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
