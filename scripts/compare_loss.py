"""Compare two training runs' loss curves (metrics.jsonl), e.g. train.fp8 against bf16 from the
same init and data, and plot them.

    python scripts/compare_loss.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl --labels bf16 fp8 \
        [--last 100] [--tolerance 0.015] [--json OUT.json] [--png OUT.png] [--jsonl OUT.jsonl]

The verdict (issue 45): the mean loss over the last ``--last`` steps of B is within ``--tolerance``
(relative) of A's, and B has no spike A does not have. A spike is a step whose loss exceeds the
median of the ``SPIKE_WINDOW`` steps before it by more than ``SPIKE_RISE`` (relative); one of B's
is matched when A spikes within ``SPIKE_SLACK`` steps of it (the same data batch hurting both).
Exit status 0 when it passes, 1 when not. ``--jsonl`` writes both curves, one row per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SPIKE_WINDOW = 20
SPIKE_RISE = 0.10
SPIKE_SLACK = 2


def losses(path: str) -> dict[int, float]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = {r["step"]: float(r["loss"]) for r in rows if "loss" in r and "step" in r}
    if not out:
        raise SystemExit(f"compare_loss: no rows with step and loss in {path}; is it a training run's metrics.jsonl?")
    return out


def spikes(curve: dict[int, float]) -> list[int]:
    steps = sorted(curve)
    found = []
    for i, s in enumerate(steps[SPIKE_WINDOW:], SPIKE_WINDOW):
        base = statistics.median(curve[t] for t in steps[i - SPIKE_WINDOW:i])
        if curve[s] > base * (1 + SPIKE_RISE):
            found.append(s)
    return found


def compare(a: dict[int, float], b: dict[int, float], last: int, tolerance: float) -> dict:
    common = sorted(set(a) & set(b))
    if len(common) < last:
        raise SystemExit(f"compare_loss: the runs share {len(common)} steps, fewer than --last {last}")
    tail = common[-last:]
    mean_a = sum(a[s] for s in tail) / last
    mean_b = sum(b[s] for s in tail) / last
    spikes_a, spikes_b = spikes(a), spikes(b)
    unmatched = [s for s in spikes_b if not any(abs(s - t) <= SPIKE_SLACK for t in spikes_a)]
    rel = (mean_b - mean_a) / mean_a
    return {"steps": len(common), "last": last, "mean_a": mean_a, "mean_b": mean_b, "rel_diff": rel,
            "tolerance": tolerance, "spikes_a": spikes_a, "spikes_b": spikes_b, "spikes_b_only": unmatched,
            "passes": abs(rel) <= tolerance and not unmatched}


def plot(a: dict[int, float], b: dict[int, float], labels: list[str], result: dict, png: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise SystemExit('compare_loss: --png needs matplotlib (pip install -e ".[plot]")') from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for curve, label in ((a, labels[0]), (b, labels[1])):
        ax.plot(sorted(curve), [curve[s] for s in sorted(curve)], label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"last {result['last']} steps: {labels[0]} {result['mean_a']:.4f}, {labels[1]} "
                 f"{result['mean_b']:.4f} ({result['rel_diff']:+.2%})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="reference run's metrics.jsonl (e.g. bf16)")
    ap.add_argument("b", help="compared run's metrics.jsonl (e.g. train.fp8)")
    ap.add_argument("--labels", nargs=2, default=["a", "b"])
    ap.add_argument("--last", type=int, default=100)
    ap.add_argument("--tolerance", type=float, default=0.015)
    ap.add_argument("--json")
    ap.add_argument("--jsonl")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    a, b = losses(args.a), losses(args.b)
    result = {"labels": args.labels, **compare(a, b, args.last, args.tolerance)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for s in sorted(set(a) | set(b)):
                f.write(json.dumps({"step": s, args.labels[0]: a.get(s), args.labels[1]: b.get(s)}) + "\n")
    if args.png:
        plot(a, b, args.labels, result, args.png)
    return 0 if result["passes"] else 1


if __name__ == "__main__":
    sys.exit(main())
