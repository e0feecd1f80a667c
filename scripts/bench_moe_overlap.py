"""MoE all-to-all overlap on vs off: the trainer with expert parallelism, same init, same batches.

    torchrun --nproc-per-node 2 scripts/bench_moe_overlap.py --config configs/qwen35_vl_proxy_moe.yaml \
        [--preset large] [key=value ...] [--warmup 3] [--steps 10] [--modes off,on] [--json OUT]

Runs ``multimodal.training.train`` once per mode in this process (``parallel.moe_a2a_overlap``
false, then true): every run seeds the same init, reads the same micro-batches, and logs per
step to its own metrics.jsonl. Reported per mode from the timed steps (after the warm-up):
step time, tokens/s (real tokens of the global batch), peak memory, the logged losses (one per
logging window of gcd(warmup, steps) steps: every step with --warmup 1),
and the number of micro-batches that went through the schedule plan (0 with the overlap off);
then the speedup (off step time / on step time) and the largest loss difference.

Defaults (before your overrides, so any can be changed): ``parallel.ep`` = world size,
``train.precision=bf16`` (megatron's overlap needs bf16), ``train.global_batch_size`` = 4
micro-batches per data-parallel rank (combined 1F1B overlaps micro-batch i+1's forward with
micro-batch i's backward, so one micro-batch per step overlaps nothing; refused below 2).

``--preset large``: the proxy is tiny (hidden 128), so its all-to-alls and experts take
microseconds and launch overhead dominates; this preset gives the layers Qwen3.5-35B-A3B's
shapes (hidden 2048, 16 query / 2 KV heads of 256, top-8 of 32 experts with ffn 512 + a gated
shared expert) at 8 layers, all gated attention (see LARGE), and 8K-token rows of ~4 samples. Overrides after it
change any of it (e.g. ``model.num_experts=64 train.seq_length=16384``). ``--modes on`` (or
``off``) runs one mode only, e.g. one per process if two runs in one process misbehave.

For a timeline: ``nsys profile -t cuda,nvtx -o moe_overlap torchrun ...`` shows the NVTX ranges
moe/shared_experts, moe/dispatch, moe/experts, moe/combine (models/common/moe_nvtx.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import tempfile
from pathlib import Path


import torch  # noqa: E402

log = logging.getLogger("bench_moe_overlap")

LARGE = [
    "model.hidden_size=2048", "model.num_layers=8", "model.num_attention_heads=16", "model.num_query_groups=2",
    "model.head_dim=256", "model.mrope_section=[11,11,10]", "model.linear_num_key_heads=16",
    "model.linear_num_value_heads=32", "model.linear_key_head_dim=128", "model.linear_value_head_dim=128",
    "model.num_experts=32", "model.moe_router_topk=8", "model.moe_ffn_hidden_size=512",
    "model.moe_shared_expert_intermediate_size=512", "model.ffn_hidden_size=512", "train.seq_length=8192",
    # every layer gated attention: without flash-linear-attention (refused on Hopper with Triton
    # 3.6 unless tilelang is installed) the PyTorch GDN path costs seconds per step and hides the
    # MoE; model.full_attention_interval=4 restores the hybrid pattern where fla runs
    "model.full_attention_interval=1",
    # a few long samples per 8K row (the mock default packs ~80 short ones): MoE-bound, not
    # bound by per-sample launches of the varlen attention / vision encoder
    "data.mock.min_text_tokens=1500", "data.mock.max_text_tokens=2000", "data.mock.max_images=1",
    "optimizer.lr=3e-4", "optimizer.min_lr=3e-5",  # the proxy's 3e-3 makes this width's loss spike
]


def run_mode(cfg, warmup: int, rank: int) -> dict:
    from models.common import schedule_plan
    from multimodal.training import train

    plans = {"n": 0}
    init = schedule_plan.MultimodalSchedulePlan.__init__

    def counting(self, *a, **k):  # proof that the overlapped schedule ran (0 with the overlap off)
        plans["n"] += 1
        init(self, *a, **k)

    schedule_plan.MultimodalSchedulePlan.__init__ = counting
    try:
        train(cfg)
    finally:
        schedule_plan.MultimodalSchedulePlan.__init__ = init
    if rank != 0:  # metrics are written by rank 0
        return {}
    rows = [json.loads(x) for x in (Path(cfg.logging.dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > warmup]
    span = [r["step_time_s"] * cfg.logging.interval for r in timed]
    tokens = sum(r["tokens_per_s"] * s for r, s in zip(timed, span))
    return {
        "step_time_s": sum(span) / (len(timed) * cfg.logging.interval),
        "tokens_per_s": tokens / sum(span),
        "peak_mem_gib": max(r["mem_peak_gib"] for r in rows),
        "losses": {r["step"]: r["loss"] for r in rows},
        "grad_norms": {r["step"]: r["grad_norm"] for r in rows},
        "microbatches_through_plan": plans["n"],
    }


def _max_diff(a: dict, b: dict) -> float:
    return max(abs(a["losses"][s] - b["losses"][s]) for s in a["losses"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="section.key=value (after the defaults and the preset)")
    ap.add_argument("--preset", choices=("proxy", "large"), default="proxy")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="off,on",
                    help="runs in order, e.g. off,on | on | off,on,off (a second off measures run-to-run noise)")
    ap.add_argument("--json", help="write the result here (JSON, rank 0)")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options
    modes = args.modes.split(",")
    if not set(modes) <= {"off", "on"} or args.warmup < 0 or args.steps < 1:
        ap.error("--modes takes a comma list of off / on (e.g. off,on,off); --warmup >= 0, --steps >= 1")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)

    from multimodal.config import load_config, resolve_sources, validate

    total = args.warmup + args.steps
    interval = math.gcd(args.warmup, args.steps)  # log exactly at the warm-up boundary
    out_dir = Path(tempfile.mkdtemp(prefix="bench_moe_overlap_"))  # fresh: metrics.jsonl of this run only
    defaults = [f"parallel.ep={world}", "train.precision=bf16", "train.micro_batch_size=1"]
    forced = [f"train.iters={total}", f"logging.interval={interval}", "checkpoint.dir=null",
              "checkpoint.save_at_end=false", "checkpoint.load=null", "logging.progress_bar=false",
              "logging.tensorboard=false", "logging.wandb=false", "logging.memory_history=false"]
    user = (LARGE if args.preset == "large" else []) + args.overrides
    probe = load_config(args.config, [*defaults, *user])
    p, t = probe.parallel, probe.train
    dp = world // (p.tp * p.pp * p.cp)
    if not any(o.startswith("train.global_batch_size=") for o in user):
        defaults.append(f"train.global_batch_size={4 * t.micro_batch_size * dp}")
    result: dict = {"config": args.config, "preset": args.preset, "overrides": args.overrides, "world_size": world,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "warmup": args.warmup, "steps": args.steps}
    for i, mode in enumerate(modes):
        key = mode if mode not in modes[:i] else f"{mode}_{modes[:i].count(mode) + 1}"
        cfg = resolve_sources(load_config(args.config, [*defaults, *user, *forced, f"logging.dir={out_dir / key}",
                                                        f"parallel.moe_a2a_overlap={mode == 'on'}"]))
        validate(cfg, world)
        t = cfg.train
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        if micro < 2:
            raise SystemExit(f"{micro} micro-batch per step: the overlap needs >= 2 (raise train.global_batch_size)")
        result.update(seq_length=t.seq_length, global_batch_size=t.global_batch_size, microbatches_per_step=micro,
                      ep=cfg.parallel.ep, dtype=t.precision)
        result[key] = run_mode(cfg, args.warmup, rank)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    if rank != 0:
        return result
    runs = [k for k in result if k.startswith(("off", "on"))]
    if "off" in result and "on" in result:
        off, on = result["off"], result["on"]
        result["speedup"] = off["step_time_s"] / on["step_time_s"]
        result["max_abs_loss_diff"] = _max_diff(off, on)
        if "off_2" in result:  # run-to-run noise of the GPU kernels (atomics), to judge the above by
            result["max_abs_loss_diff_off_vs_off"] = _max_diff(off, result["off_2"])
    text = json.dumps(result, indent=1)
    print(text)
    for mode in runs:
        r = result[mode]
        print(f"overlap {mode:5s}: {r['step_time_s'] * 1e3:8.1f} ms/step  {r['tokens_per_s']:10.0f} tokens/s  "
              f"peak {r['peak_mem_gib']:.1f} GiB  loss {r['losses'][min(r['losses'])]:.4f} -> "
              f"{r['losses'][max(r['losses'])]:.4f}  micro-batches through the plan: {r['microbatches_through_plan']}")
    if "speedup" in result:
        noise = result.get("max_abs_loss_diff_off_vs_off")
        print(f"speedup (off / on step time): {result['speedup']:.3f}x; max |loss diff| on vs off "
              f"{result['max_abs_loss_diff']:.3g}" + ("" if noise is None else f", off vs off {noise:.3g}"))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
