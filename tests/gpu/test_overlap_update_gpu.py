"""optimizer.overlap_step against the step in place, on a GPU: does any kernel read a parameter
(or accumulate a gradient) before the update on the second stream has written it?

    python tests/gpu/test_overlap_update_gpu.py [--config configs/qwen35_vl_proxy.yaml] [--steps 6] [--json OUT]

Each variant trains the same model on the same mock batches in this process (flat AdamW's
kernel, metrics every step, so the log steps' parameter norm also runs behind the update):
- ``plain`` twice: the step in place; the second run gives the run-to-run noise (the atomics in
  flash attention's and fla's backward);
- ``overlap_delayed``: the overlap, with the update stream held back ~20 ms before every update,
  so a forward that does not wait for its parameters surely reads the old ones;
- ``unguarded_delayed``: the same with the layers' waits switched off (only the wait before the
  backward kept): the race the hooks prevent. It must differ from ``plain`` by far more than the
  noise, or this check could not see a race at all;
per suite (``--suites``: fp32, bf16, bf16 with CUDA graphs), each against its own ``plain``; the
first suite also runs ``unguarded_delayed``. Pass: every guarded run within 4x the noise of its ``plain``
(floor 1e-6 relative) in loss and parameter norm at every step, the unguarded one beyond it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch


DELAY_CYCLES = 40_000_000  # ~20 ms at the H200's ~2 GHz


def _patch(delay: bool, guarded: bool):
    """Hold the update stream back before every update; optionally drop the layers' waits."""
    from multimodal.performance.overlap_update import UpdateOverlap

    run, wait = UpdateOverlap.run, UpdateOverlap._wait

    def delayed_run(self, flat, grad_scale):
        if delay and self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(DELAY_CYCLES)
        run(self, flat, grad_scale)

    def unguarded_wait(self, piece):
        if piece >= self.pieces:  # finish(): before the backward, the save, the end
            wait(self, piece)

    UpdateOverlap.run = delayed_run
    if not guarded:
        UpdateOverlap._wait = unguarded_wait
    return lambda: (setattr(UpdateOverlap, "run", run), setattr(UpdateOverlap, "_wait", wait))


def train_variant(config: str, overrides: list[str], steps: int, delay=False, guarded=True) -> list[dict]:
    from multimodal.config import load_config
    from multimodal.training import train

    restore = _patch(delay, guarded)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(config, [f"train.iters={steps}", "logging.interval=1", "checkpoint.dir=null",
                                       "logging.tensorboard=false", "logging.progress_bar=false",
                                       f"logging.dir={tmp}", "optimizer.flat=true", *overrides])
            train(cfg)
            rows = [json.loads(x) for x in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    finally:
        restore()
    return [{k: r[k] for k in ("step", "loss", "param_norm", "grad_norm")} for r in rows]


def rel_diff(a: list[dict], b: list[dict]) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        for key in ("loss", "param_norm"):
            worst = max(worst, abs(x[key] - y[key]) / max(abs(y[key]), 1e-12))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen35_vl_proxy.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=None)
    ap.add_argument("--suites", default="bf16,bf16_graphs",
                    help="comma list of fp32, bf16, bf16_graphs; the first also runs the unguarded variant")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("test_overlap_update_gpu: needs a GPU (the overlap is a second CUDA stream)", file=sys.stderr)
        return 2
    base = list(args.overrides)
    known = {
        "fp32": base + ["train.precision=fp32"],
        "bf16": base + ["train.precision=bf16"],
        "bf16_graphs": base + ["train.precision=bf16", "train.cuda_graphs=true"],
    }
    names = args.suites.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; choose from {sorted(known)}")
    suites = {n: known[n] for n in names}
    result, ok = {"config": args.config, "steps": args.steps, "device": torch.cuda.get_device_name()}, True
    for name, overrides in suites.items():
        try:
            suite = run_suite(name, args.config, overrides, args.steps, unguarded=name == names[0])
        except Exception as exc:  # noqa: BLE001 - report it and go on with the next suite
            suite = {"passed": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        ok = ok and suite["passed"]
        result[name] = suite
    result["passed"] = ok
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    return 0 if ok else 1


def run_suite(name: str, config: str, overrides: list[str], steps: int, unguarded: bool) -> dict:
    on, off = ["optimizer.overlap_step=true"], ["optimizer.overlap_step=false"]
    plain = train_variant(config, overrides + off, steps)
    again = train_variant(config, overrides + off, steps)
    noise = rel_diff(again, plain)
    bound = max(4 * noise, 1e-6)
    suite = {"noise": noise, "bound": bound, "plain": plain}
    guarded = train_variant(config, overrides + on, steps, delay=True)
    suite["overlap_delayed"] = rel_diff(guarded, plain)
    suite["overlap_rows"] = guarded
    passed = suite["overlap_delayed"] <= bound
    if unguarded:
        unguarded = train_variant(config, overrides + on, steps, delay=True, guarded=False)
        suite["unguarded_delayed"] = rel_diff(unguarded, plain)
        suite["race_visible"] = suite["unguarded_delayed"] > bound
        passed = passed and suite["race_visible"]
    suite["passed"] = passed
    print(f"{name}: noise {noise:.2e}, overlap (delayed) {suite['overlap_delayed']:.2e}"
          + (f", unguarded (delayed) {suite['unguarded_delayed']:.2e}" if "unguarded_delayed" in suite else "")
          + f" -> {'PASS' if passed else 'FAIL'}", flush=True)
    return suite


@pytest.mark.gpu
def test_overlapped_update_matches_the_plain_step(run_check):
    """The overlapped update trains like the plain step, and the delayed unguarded run shows the race it guards."""
    run_check(__file__)


if __name__ == "__main__":
    sys.exit(main())
