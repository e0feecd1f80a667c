"""End-to-end training throughput: our trainer vs transformers' model of the same architecture
(Qwen3.5(-MoE)), same process, same GPU.

    python scripts/bench_train.py --config configs/qwen35_vl_2b.yaml [key=value ...] \
        [--warmup 3] [--steps 10] [--json OUT] [--skip-hf] [--hf-feed row|samples] [--hf-gdn auto|fla|torch]

1. Ours: ``multimodal.training.train`` itself (the real loop: megatron DDP, its optimizer, the
   forward-backward schedule, prefetch) runs ``warmup + steps`` iterations; the timed figures
   come from its own metrics (``logging.interval = gcd(warmup, steps)``, so the windows after
   the warm-up cover exactly the timed steps).
2. On a GPU our run happens in a fresh child process (spawned), so that everything it
   allocated is gone when it exits (a run can keep memory after its objects are dropped, see
   docs/moe.md; ``mem_after_free_gib`` reports what our run still held after ``gc.collect`` and
   ``torch.cuda.empty_cache``, and none of it reaches the other half). Without the transformers half, or on the CPU, ours runs in-process. Then
   transformers' model is built from the same
   model section (the family's Hugging Face adapter, ``hf_config_from_ours``; a family without
   one is refused before anything runs, unless --skip-hf) with random weights in the same
   dtype, SDPA attention, flash-linear-attention's GDN kernels when importable, and
   ``torch.optim.AdamW(fused=True)`` on CUDA. It trains on the very batches our run consumed
   (the loader is rebuilt with the same seed; the supervised-token counts per step are checked
   against our metrics), warm-up then timed steps, one optimizer step per global batch.

Our run starts from random weights, or from a Hugging Face folder given as
``checkpoint.load=DIR`` (direct loading, the folder's MTP head included: its ``mtp_loss`` is
reported beside the loss); a training checkpoint is refused, its resume would continue its step
count. The recipe's own ``checkpoint.load`` is ignored.

What transformers gets: it has no packed (varlen) path with SDPA, so each packed micro-batch is
fed as
  - ``row`` (default): the real tokens of all packed samples concatenated into one sequence
    (padding dropped), with all their images, positions from transformers' own
    ``get_rope_index`` over that row; causal attention then spans sample boundaries (more
    attention work than ours; the issue's baseline is likewise one long sequence);
  - ``samples``: one forward/backward per packed sample (exactly our per-sample semantics, at
    the price of more, smaller kernels).
Labels: our (shifted) supervised labels, placed where transformers' internal shift expects them.

Both sides are credited the same work: real tokens and ``multimodal.flops.training_flops`` of
the real samples (never padding, never the cross-sample attention of ``row``; with
``model.sparse_lm_head``, the LM head at the loss tokens only, for transformers too, which
computes the logits of every token). MFU divides by
the device's dense bf16 peak (``multimodal.flops.PEAK_TFLOPS``: H100/H200 989 TFLOP/s) or
``logging.peak_tflops``; it is null when neither is known (CPU).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


import torch  # noqa: E402

log = logging.getLogger("bench_train")


class BenchError(RuntimeError):
    pass


# ------------------------------------------------------------------ ours


def run_ours(cfg, warmup: int, steps: int) -> dict:
    from multimodal.training import train

    train(cfg)
    rows = [json.loads(line) for line in (Path(cfg.logging.dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > warmup]
    if not timed:
        raise BenchError(f"no metrics rows after the {warmup} warm-up steps in {cfg.logging.dir}/metrics.jsonl")
    interval = cfg.logging.interval
    elapsed = [r["step_time_s"] * interval for r in timed]
    total = sum(elapsed)
    tokens = sum(r["tokens_per_s"] * e for r, e in zip(timed, elapsed))
    tflop = sum(r["tflops_per_gpu"] * e for r, e in zip(timed, elapsed))
    mfu = [r["mfu"] for r in timed]
    return {
        "step_time_s": total / steps,
        "tokens_per_s": tokens / total,
        "tflops_per_gpu": tflop / total,
        "mfu": None if any(x is None for x in mfu) else sum(x * e for x, e in zip(mfu, elapsed)) / total,
        "peak_mem_gib": max(r["mem_peak_gib"] for r in rows),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        # the MTP head's own loss (model.mtp_num_layers > 0), not part of "loss"'s figure
        "mtp_loss_first": rows[0].get("mtp_loss"),
        "mtp_loss_last": rows[-1].get("mtp_loss"),
        "supervised_tokens_per_window": [r["supervised_tokens"] for r in rows],
        "graph_captures_in_timed_steps": captures_in_timed_steps(rows, warmup),
        **step_spread([r["step_time_s"] for r in timed]),
        # share of the timed log windows in which some micro-batch ran eager layers instead of graphs
        "eager_step_share": eager_step_share(rows, warmup),
        "graph_capture_s": rows[-1].get("cuda_graph_capture_s"),
        # process start to the first logged step done (compilation and capture included)
        "startup_s": rows[0].get("startup_s"),
        # seconds per timed step the trainer waited for the loader (the prefetch thread fell behind)
        "data_wait_s_per_step": data_wait_per_step(rows, warmup, steps),
        "alloc_retries": alloc_retries_in_timed_steps(rows, warmup),
    }


def timed_increase(rows: list[dict], warmup: int, key: str):
    """How much metrics.jsonl's cumulative ``key`` rose over the timed steps (from the last warm-up
    row to the last row); None when no row carries it."""
    if not any(key in r for r in rows):
        return None
    before = [r.get(key, 0) for r in rows if r["step"] <= warmup]
    return rows[-1].get(key, 0) - (before[-1] if before else 0)


def data_wait_per_step(rows: list[dict], warmup: int, steps: int) -> float | None:
    """Mean host seconds per timed step spent waiting for a batch, from metrics.jsonl's cumulative
    ``data_wait_s``; None without the prefetch thread."""
    waited = timed_increase(rows, warmup, "data_wait_s")
    return None if waited is None else waited / steps


def alloc_retries_in_timed_steps(rows: list[dict], warmup: int) -> int | None:
    """The CUDA caching allocator's retries (each a synchronizing free of its cache) during the
    timed steps, from metrics.jsonl's cumulative ``alloc_retries``; None off CUDA. Non-zero: the
    step time includes the allocator working at the memory limit."""
    return timed_increase(rows, warmup, "alloc_retries")


def step_spread(times: list[float]) -> dict:
    """Median and 90th percentile (nearest rank) of per-step times; per log window when
    logging.interval > 1."""
    if not times:
        return {"step_time_median_s": None, "step_time_p90_s": None}
    ordered = sorted(times)
    return {"step_time_median_s": statistics.median(ordered),
            "step_time_p90_s": ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]}


def eager_step_share(rows: list[dict], warmup: int) -> float | None:
    """Timed log windows whose cumulative ``cuda_graph_eager_batches`` grew, over all timed
    windows; None when training ran without graphs."""
    if not any("cuda_graph_eager_batches" in r for r in rows):
        return None
    counts = [r.get("cuda_graph_eager_batches", 0) for r in rows]
    grew = [now > before for before, now, r in zip([0, *counts], counts, rows) if r["step"] > warmup]
    return sum(grew) / len(grew) if grew else None


def captures_in_timed_steps(rows: list[dict], warmup: int) -> int | None:
    """CUDA graphs captured during the timed steps (each such step also ran warm-up passes and the
    capture, so it is slower), from metrics.jsonl's cumulative ``cuda_graph_captures``; None
    when training ran without graphs."""
    return timed_increase(rows, warmup, "cuda_graph_captures")


def _ours_child(cfg, warmup: int, steps: int, queue) -> None:
    """Spawned: run ours, report what stayed allocated, exit (which frees the GPU for transformers)."""
    import traceback

    try:
        from fused_kernels.gated_delta_rule import gdn_backend
        from multimodal.platform import init_distributed

        init_distributed()
        ours = run_ours(cfg, warmup, steps)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        ours["mem_after_free_gib"] = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        ours["gdn_kernels"] = gdn_backend(cfg.model.gdn_backend)
        queue.put(("ok", ours))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"))


def run_ours_in_fresh_process(cfg, warmup: int, steps: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_ours_child, args=(cfg, warmup, steps, queue))
    child.start()
    status, payload = queue.get()
    child.join()
    if status != "ok":
        raise BenchError(f"our run failed in its process: {payload}")
    return payload


# ------------------------------------------------------------------ the same batches


def rebuild_batches(cfg, total_steps: int) -> list[list[dict]]:
    """The micro-batches of steps 1..total_steps as our (single-process) run consumed them."""
    from data.loader import MicroBatchIterator, build_dataset

    m, t = cfg.model, cfg.train
    dataset = build_dataset(m, cfg.data, t.seq_length)
    loader = MicroBatchIterator.from_config(dataset, m, cfg.data, t)
    per_step = t.global_batch_size // t.micro_batch_size
    it = iter(loader)
    return [[next(it) for _ in range(per_step)] for _ in range(total_steps)]


def split_samples(batch: dict, m) -> list[dict]:
    """Each real sample of a (packed or padded) micro-batch: its tokens, supervised labels,
    pixel rows and image grids."""
    merge2 = m.vision.spatial_merge_size**2
    grids = [tuple(int(x) for x in g) for g in batch["image_grid_thw"].tolist()]
    lengths = list(batch["sample_lengths"])
    packed = batch.get("cu_seqlens") is not None
    if packed:
        bounds = batch.get("cu_seqlens_padded")
        bounds = (bounds if bounds is not None else batch["cu_seqlens"]).tolist()
        spans = [(0, bounds[i], bounds[i] + n) for i, n in enumerate(lengths)]
    else:
        spans = [(i, 0, n) for i, n in enumerate(lengths)]
    samples, g, pix = [], 0, 0
    for row, a, b in spans:
        ids = batch["tokens"][row, a:b]
        labels = batch["labels"][row, a:b].masked_fill(batch["loss_mask"][row, a:b] == 0, -100)
        want = int((ids == m.image_token_id).sum())
        mine = []
        while want > 0:
            t, h, w = grids[g]
            mine.append(grids[g])
            want -= t * h * w // merge2
            g += 1
        if want != 0:
            raise BenchError("image tokens of a sample do not match its image grids")
        rows = sum(t * h * w for t, h, w in mine)
        samples.append({"ids": ids, "labels": labels, "pixels": batch["pixel_values"][pix:pix + rows], "grids": mine})
        pix += rows
    return samples


def hf_calls(batch: dict, m, feed: str) -> list[dict]:
    """transformers inputs for one micro-batch (see the module docstring for ``row`` vs ``samples``)."""
    samples = split_samples(batch, m)
    if feed == "row":
        samples = [{
            "ids": torch.cat([s["ids"] for s in samples]),
            "labels": torch.cat([s["labels"] for s in samples]),
            "pixels": torch.cat([s["pixels"] for s in samples]),
            "grids": [g for s in samples for g in s["grids"]],
        }]
    calls = []
    for s in samples:
        # our labels are already shifted (labels[t] is the target of token t); transformers
        # shifts internally (its logits[t] are scored against labels[t + 1])
        hf_labels = torch.full_like(s["labels"], -100)
        hf_labels[1:] = s["labels"][:-1]
        call = {"input_ids": s["ids"][None], "labels": hf_labels[None]}
        if s["grids"]:
            call["pixel_values"] = s["pixels"]
            call["image_grid_thw"] = torch.tensor(s["grids"], dtype=torch.long)
        calls.append(call)
    return calls


# ------------------------------------------------------------------ transformers


def hf_adapter(m):
    """The Hugging Face adapter of the recipe's model family; a family without one is a BenchError."""
    from core.errors import ConfigError
    from models import get_hf_adapter, get_model_family

    try:
        return get_hf_adapter(get_model_family(m.name))
    except ConfigError as e:
        raise BenchError(f"{e}; pass --skip-hf to time ours alone") from None


def build_hf(m, dtype, device, gdn: str):
    import transformers

    hf = hf_adapter(m)
    cfg_dict = hf.hf_config_from_ours(m)
    arch = cfg_dict["architectures"][0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise BenchError(f"transformers {transformers.__version__} has no {arch}; install a version that has it")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg_dict))
        config = transformers.AutoConfig.from_pretrained(d)
    config._attn_implementation = "sdpa"
    kernels = "torch"
    if gdn in ("auto", "fla") and device.type == "cuda" and importlib.util.find_spec("fla") is not None:
        kernels = "fla+flash_qla" if importlib.util.find_spec("flash_qla") is not None else "fla"
    if gdn == "fla" and not kernels.startswith("fla"):
        raise BenchError("--hf-gdn fla needs flash-linear-attention (`fla`) and a CUDA device")
    if kernels == "torch":
        force_hf_torch_gdn(hf)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the training dtype directly (a 2B fp32 copy is 8 GiB)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(prev)
    model.to(device=device, dtype=dtype)
    if kernels == "torch":
        force_hf_torch_gdn(hf, model)
    model.train()
    return model, kernels


def force_hf_torch_gdn(hf, model=None) -> None:
    """transformers picks fla's Triton kernels whenever ``fla`` imports (module-level wrappers in
    5.2x, per-layer attributes in some versions); use its own PyTorch GDN instead. ``hf``: the
    family's Hugging Face adapter, which names transformers' modules of the architecture."""
    hf.use_hf_torch_kernels()
    if model is None:
        return
    import importlib

    for modname in hf.HF_MODELING_MODULES:
        mod = importlib.import_module(modname)
        for layer in model.modules():
            if type(layer).__name__.endswith("GatedDeltaNet") and type(layer).__module__ == modname:
                for attr, fn in (("chunk_gated_delta_rule", "torch_chunk_gated_delta_rule"),
                                 ("recurrent_gated_delta_rule", "torch_recurrent_gated_delta_rule"),
                                 ("causal_conv1d_fn", None), ("causal_conv1d_update", None)):
                    if callable(getattr(layer, attr, None)) and not isinstance(getattr(layer, attr), torch.nn.Module):
                        setattr(layer, attr, getattr(mod, fn, None) if fn else None)


def run_hf(cfg, batches: list[list[dict]], warmup: int, steps: int, dtype, device, feed: str, gdn: str) -> dict:
    """transformers with its fastest GDN kernels: fla, and through fla FlashQLA when installed (our
    fla backend turns fla's FlashQLA dispatch off, fused_kernels.gated_delta_rule; transformers runs
    eagerly, where that dispatch is sound, so it gets it back for its run)."""
    from fused_kernels.gated_delta_rule import FLA_FLASH_QLA_ENV

    before = os.environ.get(FLA_FLASH_QLA_ENV)
    os.environ.pop(FLA_FLASH_QLA_ENV, None)  # fla's default: on when flash_qla imports
    try:
        return _run_hf(cfg, batches, warmup, steps, dtype, device, feed, gdn)
    finally:
        if before is not None:
            os.environ[FLA_FLASH_QLA_ENV] = before


def _run_hf(cfg, batches: list[list[dict]], warmup: int, steps: int, dtype, device, feed: str, gdn: str) -> dict:
    from multimodal.flops import device_peak_tflops, training_flops

    m, o = cfg.model, cfg.optimizer
    model, kernels = build_hf(m, dtype, device, gdn)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                  weight_decay=o.weight_decay, fused=fused)
    accepts = set(inspect.signature(model.forward).parameters)
    step_inputs = []
    for step in batches:
        calls = []
        for b in step:
            for c in hf_calls(b, m, feed):
                if "mm_token_type_ids" in accepts:  # transformers >= 5.2x wants the modality per token
                    c["mm_token_type_ids"] = (c["input_ids"] == m.image_token_id).int()
                c = {k: v.to(device) for k, v in c.items()}
                if "pixel_values" in c:
                    c["pixel_values"] = c["pixel_values"].to(dtype)
                calls.append(c)
        step_inputs.append(calls)

    def one_step(calls):
        optimizer.zero_grad(set_to_none=True)
        loss = None
        for c in calls:
            out = model(**c)
            out.loss.backward()
            loss = out.loss.detach()
        optimizer.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, loss = [], None
    for i, calls in enumerate(step_inputs):
        sync()
        t0 = time.perf_counter()
        loss = one_step(calls)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    total = sum(times)
    timed = [b for step in batches[warmup:] for b in step]
    tokens = sum(b["num_real_tokens"] for b in timed)
    # the same work credited as ours (with model.sparse_lm_head: the LM head at the loss tokens of
    # packed batches), though transformers computes the logits of every token
    sparse = m.sparse_lm_head and m.fused_linear_ce
    flops = sum(training_flops(m, b["sample_lengths"], [tuple(g) for g in b["image_grid_thw"].tolist()],
                               int((b["loss_mask"] != 0).sum()) if sparse and b.get("cu_seqlens") is not None
                               else None)
                for b in timed)
    peak = device_peak_tflops(cfg.logging.peak_tflops)
    tflops = flops / total / 1e12
    spread = step_spread(times)
    result = {
        "hf_step_time_s": total / steps,
        "hf_step_time_median_s": spread["step_time_median_s"],
        "hf_step_time_p90_s": spread["step_time_p90_s"],
        "hf_tokens_per_s": tokens / total,
        "hf_tflops_per_gpu": tflops,
        "hf_mfu": tflops / peak if peak else None,
        "hf_peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None),
        "hf_loss_last": float(loss) if loss is not None else None,
        "hf_gdn_kernels": kernels,
        "hf_feed": feed,
        "hf_forward_calls_per_step": len(step_inputs[0]),
    }
    del model, optimizer, step_inputs
    return result


# ------------------------------------------------------------------ recompute sweep


def run_ours_again(args, log_dir: Path, overrides: list[str], rt) -> dict:
    """Ours once more in this process, a fresh model built from ``args.config`` and ``overrides``
    (the extra runs of --recompute-sweep and --ab), after freeing what the last run left cached."""
    from multimodal.config import load_config, resolve_sources

    cfg = load_config(args.config, [f"logging.dir={log_dir}", *overrides])
    resolve_sources(cfg)
    gc.collect()
    if rt.is_cuda:
        torch.cuda.empty_cache()
    return run_ours(cfg, args.warmup, args.steps)


def recompute_sweep(args, out_dir: str, forced: list[str], rt) -> dict:
    """Ours once per recompute choice (fresh model each time): the memory each module saves."""
    from multimodal.config import load_config

    from multimodal.performance.recompute import sweep_choices

    out = {}
    for mods in sweep_choices(load_config(args.config, args.overrides).model):
        name = ",".join(mods) or "none"
        d = Path(out_dir) / f"recompute_{name.replace(',', '+')}"
        # every row eager: CUDA graphs (on in the 2B recipe) cannot be combined with recompute
        r = run_ours_again(args, d, [*args.overrides, *forced, "train.cuda_graphs=false",
                                     f"train.recompute_modules=[{','.join(mods)}]"], rt)
        out[name] = {k: r[k] for k in ("peak_mem_gib", "step_time_s", "tokens_per_s", "loss_last")}
        log.info("recompute %s: peak %.2f GiB, %.3f s/step", name, r["peak_mem_gib"], r["step_time_s"])
    base = out["none"]["peak_mem_gib"]
    for row in out.values():
        row["saved_gib"] = base - row["peak_mem_gib"]
    return out


# ------------------------------------------------------------------ A/B runs


def ab_runs(args, out_dir: str, forced: list[str], rt) -> dict:
    """For each --ab override set: ours with it (B), then ours as given again (A), fresh models,
    in this process. With the main run that makes A, B, A: a drift (clocks, caches) shows as A != A."""
    out = {}
    for i, spec in enumerate(args.ab):
        extra = [kv for kv in spec.split(",") if kv]
        rows = {}
        for name, overrides in (("b", extra), ("a_again", [])):
            # (the trainer resets the peak-memory counter itself once the model is built)
            r = run_ours_again(args, Path(out_dir) / f"ab{i}_{name}", [*args.overrides, *overrides, *forced], rt)
            rows[name] = {k: r.get(k) for k in ("step_time_s", "step_time_median_s", "step_time_p90_s", "tokens_per_s", "mfu",
                                                "peak_mem_gib", "loss_last", "mtp_loss_last", "data_wait_s_per_step",
                                                "alloc_retries")}
            log.info("ab %s %s: %.4f s/step", spec, name, r["step_time_s"])
        out[spec] = rows
    return out


def _fp8_recipe(overrides: list[str]) -> str | None:
    """The train.fp8 a list of overrides leaves set (the last one wins; null: bf16)."""
    value = None
    for kv in overrides:
        key, _, v = kv.partition("=")
        if key.strip() == "train.fp8":
            value = None if v.strip().lower() in ("null", "none", "") else v.strip()
    return value


def add_fp8_speedup(ab: dict, main_overrides: list[str], main_tokens_per_s: float) -> None:
    """Each A/B whose two sides differ in train.fp8 gets ``fp8_speedup``: FP8 tokens/s over
    bf16's, the A side being the mean of the two A runs (before and after B: drift cancels)."""
    a_fp8 = _fp8_recipe(main_overrides)
    for spec, rows in ab.items():
        b_fp8 = _fp8_recipe([*main_overrides, *spec.split(",")])
        a_tps = [t for t in (main_tokens_per_s, rows["a_again"].get("tokens_per_s")) if t]
        b_tps = rows["b"].get("tokens_per_s")
        if (a_fp8 is None) == (b_fp8 is None) or not a_tps or not b_tps:
            continue
        a_mean = sum(a_tps) / len(a_tps)
        rows["fp8_speedup"] = b_tps / a_mean if b_fp8 else a_mean / b_tps
        rows["fp8_recipe"] = b_fp8 or a_fp8


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="write the result here (JSON)")
    ap.add_argument("--skip-hf", action="store_true", help="only our trainer")
    ap.add_argument("--hf-feed", choices=("row", "samples"), default="row")
    ap.add_argument("--recompute-sweep", action="store_true",
                    help="also run ours once per train.recompute_modules choice and report peak memory / speed")
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="after ours, run ours again with these overrides, then as given again (A, B, A in one "
                         "process, so caches and autotuning are shared); repeatable. An A/B that switches "
                         "train.fp8 reports fp8_speedup (FP8 tokens/s over bf16's)")
    ap.add_argument("--ours-process", choices=("auto", "fresh", "same"), default="auto",
                    help="run ours in a spawned process (auto: on a GPU when the transformers half follows)")
    ap.add_argument("--hf-gdn", choices=("auto", "fla", "torch"), default="auto",
                    help="transformers' GDN kernels: fla when importable on CUDA (auto), or its PyTorch path")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the options
    if args.warmup < 0 or args.steps < 1:
        ap.error("--warmup must be >= 0 and --steps >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from multimodal.config import load_config, resolve_sources
    from multimodal.platform import init_distributed

    total = args.warmup + args.steps
    interval = math.gcd(args.warmup, args.steps)
    out_dir = tempfile.mkdtemp(prefix="bench_train_")
    # ours: no checkpoints written, no progress bar / TensorBoard; logs exactly at the warm-up boundary.
    # A checkpoint.load given on the command line is kept (e.g. a Hugging Face folder: the bench then
    # starts from its weights); the recipe's own (a resume from checkpoint.dir) is not.
    keep_load = any(kv.partition("=")[0].strip() == "checkpoint.load" for kv in args.overrides)
    forced = [f"train.iters={total}", f"logging.interval={interval}", "checkpoint.dir=null",
              "checkpoint.save_at_end=false", *([] if keep_load else ["checkpoint.load=null"]),
              "logging.progress_bar=false", "logging.tensorboard=false", "logging.wandb=false",
              "logging.memory_history=false"]
    cfg = load_config(args.config, [f"logging.dir={out_dir}", *args.overrides, *forced])
    if keep_load:
        from multimodal.hf_convert import is_hf_folder

        if not is_hf_folder(cfg.checkpoint.load):
            raise BenchError(f"checkpoint.load={cfg.checkpoint.load}: the bench times steps from 1 and starts from "
                             "weights only; give it a Hugging Face folder (config.json + safetensors), not a "
                             "training checkpoint (a resume would continue its step count)")
    resolve_sources(cfg)
    if not args.skip_hf:
        hf_adapter(cfg.model)  # a family without one is refused before our half runs
    lg = cfg.logging
    if lg.profile_step and lg.profile_step + lg.profile_num_steps - 1 > args.warmup:
        # the profiler's own cost (trace collection and export: seconds) would land in the timing
        raise BenchError(f"logging.profile_step={lg.profile_step} (x{lg.profile_num_steps}) reaches the timed steps; "
                         f"profile warm-up steps only (profile_step + profile_num_steps - 1 <= --warmup {args.warmup})")
    rt = init_distributed()
    if rt.world_size != 1:
        raise BenchError("bench_train.py compares one GPU with transformers on the same GPU: run it as one "
                         f"process (world size is {rt.world_size})")
    device = rt.device
    from multimodal.training import resolve_dtype

    dtype = resolve_dtype(cfg.train.precision, rt)

    fresh = args.ours_process == "fresh" or (args.ours_process == "auto" and rt.is_cuda and not args.skip_hf)
    ours = run_ours_in_fresh_process(cfg, args.warmup, args.steps) if fresh else run_ours(cfg, args.warmup, args.steps)
    from fused_kernels.gated_delta_rule import gdn_backend

    ab = ab_runs(args, out_dir, forced, rt) if args.ab else None
    gc.collect()
    if rt.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    result = {
        "device": torch.cuda.get_device_name() if rt.is_cuda else "cpu",
        "config": args.config,
        "overrides": args.overrides,
        "dtype": str(dtype).replace("torch.", ""),
        "warmup": args.warmup,
        "steps": args.steps,
        "seq_length": cfg.train.seq_length,
        "global_batch_size": cfg.train.global_batch_size,
        "peak_tflops": __import__("multimodal.flops", fromlist=["x"]).device_peak_tflops(cfg.logging.peak_tflops),
        **{k: v for k, v in ours.items() if k not in ("supervised_tokens_per_window", "mem_after_free_gib",
                                                        "gdn_kernels")},
        # what our run held after its objects were dropped (on a GPU, measured in its own process)
        "mem_after_free_gib": ours.get("mem_after_free_gib",
                                       torch.cuda.memory_allocated() / 2**30 if rt.is_cuda else None),
        "ours_in_fresh_process": fresh,
        # real tokens / the tokens each step processes (pad included): how full the rows are
        "real_token_fraction": ours["tokens_per_s"] * ours["step_time_s"]
        / (cfg.train.global_batch_size * cfg.train.seq_length),
        # the GDN delta-rule kernels our run used (model.gdn_backend resolved: flash_qla | fla | torch)
        "gdn_kernels": ours.get("gdn_kernels") or gdn_backend(cfg.model.gdn_backend),
        "torch": torch.__version__,
    }
    if ab is not None:
        add_fp8_speedup(ab, args.overrides, ours["tokens_per_s"])
        result["ab"] = ab
    hf_keys = ("hf_tokens_per_s", "hf_tflops_per_gpu", "hf_mfu", "hf_peak_mem_gib", "hf_step_time_s")
    result.update({k: None for k in hf_keys})
    result["speedup_vs_hf"] = None
    if not args.skip_hf:
        # our half first: a run cut short inside transformers' half (a timeout) keeps our figures
        _write(args.json, dict(result, hf_error="not finished: the transformers half had not completed"))
        print(f"bench_train: ours {result['tokens_per_s']} tokens/s, {result['step_time_s']} s/step "
              f"(written to {args.json}); transformers next", file=sys.stderr, flush=True)
        import transformers

        result["transformers"] = transformers.__version__
        batches = rebuild_batches(cfg, total)
        # the rebuilt batches must be the ones our run trained on: compare supervised tokens per window
        sup = [sum(int(b["loss_mask"].sum()) for step in batches[i:i + interval] for b in step)
               for i in range(0, total, interval)]
        if sup != ours["supervised_tokens_per_window"]:
            raise BenchError(f"rebuilt batches differ from the trained ones (supervised tokens {sup} vs "
                             f"{ours['supervised_tokens_per_window']})")
        retry = False
        try:
            result.update(run_hf(cfg, batches, args.warmup, args.steps, dtype, device, args.hf_feed, args.hf_gdn))
        except torch.cuda.OutOfMemoryError as e:
            result["hf_error"] = f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # noqa: BLE001 - keep our figures; say what failed on their side
            if args.hf_gdn != "auto" or importlib.util.find_spec("fla") is None or not rt.is_cuda:
                raise
            # e.g. fla 0.6.0's gated chunk backward refuses Hopper with some Triton versions
            result["hf_fla_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            retry = True
        if retry:  # outside the except block, so the failed run's frames (its model) are gone
            log.warning("transformers with flash-linear-attention failed (%s); retrying with its PyTorch GDN",
                        result["hf_fla_error"])
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                result.update(run_hf(cfg, batches, args.warmup, args.steps, dtype, device, args.hf_feed, "torch"))
            except torch.cuda.OutOfMemoryError as e:
                result["hf_error"] = f"out of memory: {str(e).splitlines()[0]}"
        if result["hf_tokens_per_s"]:
            result["speedup_vs_hf"] = result["tokens_per_s"] / result["hf_tokens_per_s"]
    if args.recompute_sweep:
        result["recompute_sweep"] = recompute_sweep(args, out_dir, forced, rt)
    print(json.dumps(result, indent=1))
    _summary(result)
    _write(args.json, result)
    return result


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def _summary(r: dict) -> None:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    print(f"\n{r['config']} on {r['device']} ({r['dtype']}, seq {r['seq_length']}, {r['steps']} timed steps)",
          file=sys.stderr)
    print(f"  ours: {f(r['step_time_s'], '.3f')} s/step  {f(r['tokens_per_s'], ',.0f')} tokens/s  "
          f"{f(r['tflops_per_gpu'], '.1f')} TFLOP/s  MFU {f(r['mfu'], '.1%')} (peak {r['peak_tflops']})  "
          f"peak mem {f(r['peak_mem_gib'], '.1f')} GiB  real tokens {f(r.get('real_token_fraction'), '.1%')} "
          "of the rows" + (f"  allocator retries in the timed steps {r['alloc_retries']}" if r.get("alloc_retries") else ""),
          file=sys.stderr)
    if r.get("mtp_loss_last") is not None:
        print(f"        loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}, mtp_loss {r['mtp_loss_first']:.4f} -> "
              f"{r['mtp_loss_last']:.4f}", file=sys.stderr)
    if r.get("step_time_median_s") is not None:
        eager = r.get("eager_step_share")
        print(f"        step time median {r['step_time_median_s']:.3f} s, p90 {r['step_time_p90_s']:.3f} s"
              + ("" if eager is None else f"; {eager:.0%} of the timed steps ran some layers eagerly, "
                 f"{r.get('graph_capture_s') or 0:.1f} s of graph capture in the run"), file=sys.stderr)
    if r.get("data_wait_s_per_step"):
        print(f"        {r['data_wait_s_per_step']:.3f} s per step waiting for the loader (data.loader.num_workers "
              "adds decode processes)", file=sys.stderr)
    if r.get("graph_captures_in_timed_steps"):
        print(f"        ({r['graph_captures_in_timed_steps']} CUDA graph capture(s) inside the timed steps: "
              "a longer --warmup leaves them out)", file=sys.stderr)
    if r.get("hf_tokens_per_s") is not None:
        print(f"  HF:   {f(r['hf_step_time_s'], '.3f')} s/step  {f(r['hf_tokens_per_s'], ',.0f')} tokens/s  "
              f"{f(r['hf_tflops_per_gpu'], '.1f')} TFLOP/s  MFU {f(r['hf_mfu'], '.1%')}  "
              f"peak mem {f(r['hf_peak_mem_gib'], '.1f')} GiB  (GDN kernels: {r['hf_gdn_kernels']}, feed: "
              f"{r['hf_feed']})", file=sys.stderr)
        print(f"  ours / HF tokens/s: {r['speedup_vs_hf']:.2f}x", file=sys.stderr)
    elif r.get("hf_error"):
        print(f"  HF: {r['hf_error']}", file=sys.stderr)
    for spec, rows in (r.get("ab") or {}).items():
        print(f"  A/B {spec}: A {r['step_time_s']:.4f}, B {rows['b']['step_time_s']:.4f}, A again "
              f"{rows['a_again']['step_time_s']:.4f} s/step (B peak mem {rows['b']['peak_mem_gib']:.1f} GiB"
              + "".join(f", {side} allocator retries {rows[k]['alloc_retries']}" for side, k in (("B", "b"), ("A again", "a_again"))
                        if rows[k].get("alloc_retries")) + ")"
              + (f"; FP8 ({rows['fp8_recipe']}) / bf16 tokens/s {rows['fp8_speedup']:.3f}x" if "fp8_speedup" in rows else "")
              + "".join(f"; {side} last mtp_loss {rows[k]['mtp_loss_last']:.4f}" for side, k in (("B", "b"), ("A", "a_again"))
                        if rows[k].get("mtp_loss_last") is not None),
              file=sys.stderr)
    for name, row in (r.get("recompute_sweep") or {}).items():
        print(f"  recompute {name:45s} peak {row['peak_mem_gib']:7.2f} GiB (saves {row['saved_gib']:6.2f})  "
              f"{row['step_time_s']:.3f} s/step", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"bench_train.py: {e}", file=sys.stderr)
        sys.exit(2)
