"""Draws the metrics page's picture from a run's metrics.jsonl (needs matplotlib:
`pip install matplotlib`, which the `docs` extra leaves out to keep CI's install short):

    python docs/scripts/plot_metrics.py outputs/quickstart/run/metrics.jsonl \
        docs/reference/quickstart_metrics.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# (title, [(metric, label)], log scale): the plots the metrics page says to watch.
PANELS = (
    ("reward", [("reward/mean", "reward/mean (train)"), ("val/accuracy", "val/accuracy")], False),
    ("KL to the reference", [("actor/kl_ref", "actor/kl_ref")], False),
    ("log-prob gap after sync", [("rollout/logprob_gap_max", "max"),
                                 ("rollout/logprob_gap_mean", "mean")], True),
    ("entropy", [("actor/entropy", "actor/entropy")], False),
    ("response length (tokens)", [("response_length/mean", "mean"),
                                  ("response_length/max", "max")], False),
    ("step timings (s)", [("timing/step", "step"), ("timing/generate", "generate"),
                          ("timing/update_actor", "update_actor"),
                          ("timing/update_critic", "update_critic")], False),
)


def main(metrics_path: str, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6), dpi=80)
    for ax, (title, series, log) in zip(axes.flat, PANELS):
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), float)]
            if key == "timing/step":  # step 0 is validation only; skip the warm-up step too
                points = [p for p in points if p[0] > 1]
            ax.plot(*zip(*points), label=label, marker="o" if key == "val/accuracy" else None,
                    linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
