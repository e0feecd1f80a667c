"""Does the training loop make the host wait for the GPU in the steady state?

    python tests/gpu/test_host_syncs_gpu.py [--config configs/qwen35_vl_proxy.yaml] [--steps 8] [--json OUT]

A step that waits for the GPU (a ``.item()``, a copy from pageable memory, a stream
synchronize) lets the device run dry while the host then prepares the next batch: one such copy
in the log step cost the 2B step with varied images ~14 ms of GPU idle. This check trains the
given config with metrics every step and, from ``--from-step`` on, turns on
``torch.cuda.set_sync_debug_mode("warn")``, which reports every synchronizing CUDA call. The
only reads the loop means to make, the log row's (``step_metrics.emit``: the previous log step's
numbers, through events, one step behind), run with the check off.

Variants: eager layers, and CUDA graphs with every vision bucket captured before training
(``train.cuda_graphs.vision_warmup_patches``; a capture mid-run synchronizes by design). Pass: no
synchronizing call in any checked step of either; the JSON lists each one found by file and line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

SYNC_WARNING = "synchronizing CUDA operation"


def sync_sites(config: str, overrides: list[str], steps: int, from_step: int) -> Counter:
    """Train; return {"file:line (function)": count} of the synchronizing calls from ``from_step``."""
    from multimodal import step_metrics, training
    from multimodal.config import load_config
    from multimodal.observability.profiling import StepProfiler

    sites: Counter = Counter()
    begin, end, emit, show = StepProfiler.begin, StepProfiler.end, step_metrics.emit, warnings.showwarning

    def checked_begin(self, it):
        if it >= from_step:
            torch.cuda.set_sync_debug_mode("warn")
        begin(self, it)

    def checked_end(self, it):  # the run's end (summaries, the last log row) is not a step
        end(self, it)
        if it >= steps:
            torch.cuda.set_sync_debug_mode(0)

    def unchecked_emit(*args, **kwargs):  # the loop's one intended read
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return emit(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if "site-packages" not in f.filename and "/torch/" not in f.filename]
        where = (ours or frames)[-1]
        sites[f"{Path(where.filename).name}:{where.lineno} ({where.name})"] += 1

    StepProfiler.begin, StepProfiler.end, step_metrics.emit = checked_begin, checked_end, unchecked_emit
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            cfg = load_config(config, [f"train.iters={steps}", "logging.interval=1", "checkpoint.dir=null",
                                       "logging.tensorboard=false", "logging.progress_bar=false",
                                       f"logging.dir={tmp}", *overrides])
            training.train(cfg)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        StepProfiler.begin, StepProfiler.end, step_metrics.emit = begin, end, emit
    return sites


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen35_vl_proxy.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--from-step", type=int, default=4, help="first checked step (earlier ones compile and capture)")
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("test_host_syncs_gpu: needs a GPU", file=sys.stderr)
        return 2
    variants = {
        "eager": ["train.cuda_graphs=false"],
        "cuda_graphs": ["train.cuda_graphs=true", "train.cuda_graphs.vision_warmup_patches=-1"],
    }
    result, ok = {"config": args.config, "steps": args.steps, "from_step": args.from_step,
                  "device": torch.cuda.get_device_name()}, True
    for name, overrides in variants.items():
        sites = sync_sites(args.config, [*args.overrides, *overrides], args.steps, args.from_step)
        result[name] = dict(sites)
        ok = ok and not sites
        print(f"{name}: {sum(sites.values())} synchronizing calls in steps {args.from_step}-{args.steps}"
              + "".join(f"\n  {n}x {site}" for site, n in sites.most_common()), flush=True)
    result["passed"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


@pytest.mark.gpu
def test_training_steps_never_wait_for_the_gpu(run_check):
    """After the first steps, no training step makes a synchronizing CUDA call outside the log read."""
    run_check(__file__)


if __name__ == "__main__":
    sys.exit(main())
