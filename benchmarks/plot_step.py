"""Plot benchmarks/results/step.json (bench_step.py): step time against context, one line per path.

    python benchmarks/plot_step.py [step.json [step.png]]

One panel per batch size; log-log axes.  Needs matplotlib (not a test dependency).
"""

from __future__ import annotations

import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PATHS = [  # (column, label, style)
    ("jax_device_us", "JAX jit step (GPU time, CUPTI)", dict(color="tab:blue", marker="o", markersize=9,
                                                                 fillstyle="none")),
    ("jax_wall_us", "JAX jit step (wall clock per call)", dict(color="tab:blue", marker="o", linestyle=":")),
    ("torch_graph_us", "torch step (CUDA graph)", dict(color="tab:orange", marker="s")),
    ("torch_eager_us", "torch step (eager)", dict(color="tab:orange", marker="s", linestyle=":")),
    ("dense_graph_us", "dense attention layer (SDPA, CUDA graph)", dict(color="tab:gray", marker="^")),
]


def plot(json_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        results = json.load(f)
    rows = results["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 4.2), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        for column, label, style in PATHS:
            points = [(r["context"], r[column]) for r in mine if r.get(column)]
            if points:
                ax.plot(*zip(*points), label=label, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([r["context"] for r in mine], [f"{r['context'] // 1024}K" for r in mine])
        ax.set_title(f"{batch} request{'s' if batch > 1 else ''}, one decode row each")
        ax.set_xlabel("context (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("µs per step (one layer)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    gpu = results.get("environment", {}).get("gpu", "CPU")
    fig.suptitle(f"One QSA attention layer's decode step (all four stages) vs a dense attention layer ({gpu})")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


if __name__ == "__main__":
    source = sys.argv[1] if len(sys.argv) > 1 else os.path.join(RESULTS, "step.json")
    target = sys.argv[2] if len(sys.argv) > 2 else os.path.splitext(source)[0] + ".png"
    plot(source, target)
