"""Plot benchmarks/results/h200/step.json (bench_step.py): step time against context, one line per path.

    python benchmarks/plot_step.py [step.json [step.png]] [--overlay later.json ...]

One panel per batch size; log-log axes.  ``--overlay`` draws the points of
later runs (of some shapes only) over the lines as stars, labelled with their
file.  With no arguments it redraws the committed figure: step.json's grid
(the latest full run, the figures the README cites).  Needs matplotlib (not
a test dependency).
"""

from __future__ import annotations

import argparse
import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PATHS = [  # (column, label, style)
    ("jax_device_us", "JAX jit step (GPU time, CUPTI)", dict(color="tab:blue", marker="o", markersize=9,
                                                                 fillstyle="none")),
    ("jax_wall_us", "JAX jit step (wall clock per call)", dict(color="tab:blue", marker="o", linestyle=":")),
    ("torch_graph_us", "torch step (CUDA graph)", dict(color="tab:orange", marker="s")),
    ("torch_eager_us", "torch step (eager)", dict(color="tab:orange", marker="s", linestyle=":")),
    ("dense_graph_us", "dense attention layer (SDPA, CUDA graph)", dict(color="tab:gray", marker="^")),
]
#: The paths an overlay draws (its stars take the path's colour).
OVERLAID = ("torch_graph_us", "jax_device_us", "dense_graph_us")


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def plot(json_path: str, png_path: str, overlays: tuple[str, ...] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = _load(json_path)
    later = [(os.path.basename(path), _load(path)) for path in overlays]
    rows = results["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 4.2), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        for column, label, style in PATHS:
            points = [(r["context"], r[column]) for r in mine if r.get(column)]
            if points:
                ax.plot(*zip(*points), label=label, **style)
        for name, run in later:
            for column, label, style in PATHS:
                points = [(r["context"], r[column]) for r in run["rows"] if r["batch"] == batch and r.get(column)]
                if column in OVERLAID and points:
                    ax.plot(*zip(*points), linestyle="none", marker="*", markersize=13, color=style["color"],
                            markeredgecolor="black", markeredgewidth=0.5, label=f"{label.split(' (')[0]}: {name}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([r["context"] for r in mine], [f"{r['context'] // 1024}K" for r in mine])
        ax.set_title(f"{batch} request{'s' if batch > 1 else ''}, one decode row each")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per step (one layer)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8, frameon=False)
    environment = results.get("environment", {})
    runs = "; ".join([f"lines: {os.path.basename(json_path)} ({environment.get('time', '?')})"]
                     + [f"stars: {name} ({run.get('environment', {}).get('time', '?')})" for name, run in later])
    fig.suptitle(f"One QSA attention layer's decode step (all four stages) vs a dense attention layer "
                 f"({environment.get('gpu', 'CPU')}, torch {environment.get('torch', '?')}, triton "
                 f"{environment.get('triton', '?')}, jax {environment.get('jax', '?')})\n{runs}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12 if later else 0.07, 1, 1))
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="the grid's JSON (default: results/h200/step.json)")
    parser.add_argument("target", nargs="?", help="the PNG to write (default: the source's name, .png)")
    parser.add_argument("--overlay", action="append", help="a later run's JSON, drawn as stars (repeatable)")
    arguments = parser.parse_args()
    source = arguments.source or os.path.join(RESULTS, "h200", "step.json")
    overlays = arguments.overlay
    if overlays is None:  # the committed figure: step.json's grid alone (the latest full run)
        overlays = []
    plot(source, arguments.target or os.path.splitext(source)[0] + ".png", tuple(overlays))
