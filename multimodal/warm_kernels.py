"""Compile a recipe's GPU kernels ahead of training, into ``train.kernel_cache``.

    python -m multimodal.warm_kernels --config configs/qwen35_vl_35b_a3b.yaml [key=value ...] [--jobs N]
    python -m multimodal.warm_kernels --config configs/qwen35_vl_2b.yaml --dry-list   # the plan; no GPU needed

On a fresh GPU machine the first step of a new recipe waits minutes for FlashQLA's TileLang kernels
to compile and for Triton's autotuner. A Slurm job runs this once per node before ``srun`` starts
training (scripts/slurm/train.sbatch); training then finds every kernel in the cache folder
(core/kernel_cache.py), which may also sit on a file system every node shares.

No model is built (the 397B recipe warms on one GPU): for one rank's shapes (GDN heads per tp and
cp rank, key/value head dims, the dtype, packed or padded rows of ``train.seq_length`` tokens) it
drives the kernel entry points the layers call, forward and backward, on small synthetic tensors:
- ``flash_qla``: FlashQLA's delta rule (fused_kernels/flash_qla_gdr.py), TileLang;
- ``fla``: flash-linear-attention's delta rule (``model.gdn_backend=fla``, or FlashQLA refusing the
  dtype or head dims), Triton, autotuned;
- ``pre_gdr``: the fused conv + SiLU + l2-norm + gates kernels (fused_kernels/fused_pre_gdr.py), autotuned;
- ``conv1d``: fla's causal conv1d where the pre-GDR chain runs unfused (``model.gdn_pre_impl=unfused``);
- ``mrope``: the decoder's MRoPE and the vision encoder's 2-D rotary (fused_kernels/fused_mrope.py), autotuned.

What the cache is keyed on, so what has to be covered (everything else is a runtime size: token
and sample counts are TileLang ``T.dynamic`` dims, or in the Triton kernels' ``do_not_specialize``):
- TileLang (FlashQLA 0.1.3): heads, head dims, dtypes, the ``cu_seqlens`` dtype, varlen or dense,
  with or without an intra-card split (its own kernels: warm-up chunk counts, state corrections),
  and the forward's ``block_DV``, which FlashQLA picks from segments (or pieces) x heads against 70%
  of the SMs: 32, 64 or 128. Packed rows change their sample count every batch and FlashQLA cuts
  long samples as it sees fit, so every reachable (split, block_DV) pair is warmed.
- Triton: each kernel's ``tl.constexpr`` arguments and autotune keys (heads, widths, ``VARLEN``;
  pre_gdr's backward ``TPP``, set by tokens x heads, so by ``train.seq_length``; the binary-search
  depth over ``cu_seqlens``, bucketed at 64 and 128 entries), plus Triton's own specialisation of
  integer arguments (1, multiples of 16) and of pointers (16-byte aligned or not). The synthetic
  tensors therefore take the layouts the layers hand over (the in_proj output [S, B, D] seen
  through its transpose, the context-parallel head groups' column views and parameter slices).

TileLang jobs run in parallel processes (compiling is CPU work); the autotuned Triton jobs run one
after another in one process, on its own GPU when the node has several, so their benchmarks are
not disturbed. The summary has one line per kernel family and the total time.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from core.errors import ConfigError, TrainingError, one_line

# the recipe loader (models, megatron) is imported in main(): the spawned workers import this module
# again, and need none of it

FAMILIES = ("flash_qla", "fla", "pre_gdr", "conv1d", "mrope")  # summary order
H200_SMS = 132  # --dry-list on a machine without a GPU plans for an H200
QLA_CTA_SHARE = 0.7  # FlashQLA's forward: block_DV from segments x heads against this share of the SMs
# cu_seqlens entries of the packed rows warmed: a few samples, and more than 64 (the kernels' search
# over cu_seqlens is one step deeper, fused_kernels/triton_support.cu_steps); the CUDA graphs' table too
CU_ENTRIES = (4, 66)
VISION_PATCHES = 1024  # any count: the vision rotary's patch count is not specialised on


@dataclass(frozen=True)
class RankShapes:
    """What one rank's kernels see. GDN: ``tp_*`` heads are the rank's share of in_proj; under
    context parallelism each delta-rule call runs ``1/cp`` of them over the whole row (head-parallel
    all-to-all, models/common/cp_collectives.py), with q and k repeated up to the value heads."""

    dtype: str  # torch dtype name: bfloat16 (train.precision auto/bf16 on a GPU) or float32
    seq: int  # tokens of one GDN call: the whole row (sequence parallelism and CP gather it)
    batch: int  # rows per micro-batch (1 when packed)
    packed: bool
    tp: int
    cp: int
    tp_key_heads: int
    tp_value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    attn_tokens: int  # tokens at the decoder attention's rotary: seq / cp (the rank's own tokens)
    attn_heads: int
    attn_kv_heads: int
    head_dim: int
    rot_dim: int
    rope_theta: float
    mrope_section: tuple[int, ...]
    mrope_interleaved: bool
    vision_heads: int
    vision_head_dim: int
    vision_rope_theta: float
    graph_cu_entries: int | None  # cu_seqlens entries of the decoder CUDA graphs' rows, else None

    @property
    def key_heads(self) -> int:  # key heads of one delta-rule call
        return self.tp_key_heads // self.cp

    @property
    def heads(self) -> int:  # value heads of one delta-rule call (q and k are repeated to these)
        return self.tp_value_heads // self.cp

    def describe(self) -> str:
        rows = f"{self.seq}-token packed rows" if self.packed else f"{self.batch} x {self.seq}-token padded rows"
        return (f"GDN {self.key_heads} key / {self.heads} value heads of {self.key_dim}/{self.value_dim} per call "
                f"(tp={self.tp}, cp={self.cp}), {rows}, {self.dtype}; attention {self.attn_heads} q / "
                f"{self.attn_kv_heads} kv heads of {self.head_dim} on {self.attn_tokens} tokens; vision "
                f"{self.vision_heads} heads of {self.vision_head_dim}")


def rank_shapes(cfg) -> RankShapes:
    """One rank's kernel shapes from the recipe (a Gated DeltaNet family: Qwen3.5-VL)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not hasattr(m, "linear_num_value_heads"):
        raise ConfigError(f"multimodal.warm_kernels warms the Gated DeltaNet kernels; model.name={m.name} has none "
                          "(its kernels compile at the first step)")
    t.validate()
    graphs = t.cuda_graphs.enabled and cfg.data.pack
    return RankShapes(
        dtype="float32" if t.precision == "fp32" else "bfloat16", seq=t.seq_length,
        batch=1 if cfg.data.pack else t.micro_batch_size, packed=cfg.data.pack, tp=p.tp, cp=p.cp,
        tp_key_heads=m.linear_num_key_heads // p.tp, tp_value_heads=m.linear_num_value_heads // p.tp,
        key_dim=m.linear_key_head_dim, value_dim=m.linear_value_head_dim, conv_width=m.linear_conv_kernel_dim,
        attn_tokens=t.seq_length // p.cp, attn_heads=m.num_attention_heads // p.tp,
        attn_kv_heads=max(1, m.num_query_groups // p.tp), head_dim=m.head_dim,
        rot_dim=int(m.head_dim * m.partial_rotary_factor), rope_theta=m.rope_theta,
        mrope_section=tuple(m.mrope_section), mrope_interleaved=m.mrope_interleaved,
        vision_heads=m.vision.num_heads, vision_head_dim=m.vision.hidden_size // m.vision.num_heads,
        vision_rope_theta=m.vision.rope_theta,
        # layer_graphs.StaticBatch: max_samples segments, one always-empty padding segment, the end
        graph_cu_entries=t.cuda_graphs.max_samples + 2 if graphs else None,
    )


@dataclass(frozen=True)
class Setting:
    """What the kernels resolve to on the machine: the GDN backend (fused_kernels/gated_delta_rule.
    gdn_backend), the pre-GDR and MRoPE paths, whether fla can run, and FlashQLA's CTA target."""

    gdn_backend: str  # flash_qla | fla | torch
    fused_pre: bool
    fused_mrope: bool
    fla_usable: bool
    qla_ctas: int  # FlashQLA's forward: TARGET_NUM_CTAS
    device: str  # for the summary

    @classmethod
    def assumed(cls, cfg) -> "Setting":
        """--dry-list without a GPU: an H200 with the gpu extras installed (FlashQLA, tilelang)."""
        m = cfg.model
        backend = {"auto": "flash_qla"}.get(m.gdn_backend, m.gdn_backend)
        return cls(backend, m.gdn_pre_impl != "unfused", m.fused_mrope is not False, True,
                   int(H200_SMS * QLA_CTA_SHARE), f"assumed: an H200 ({H200_SMS} SMs) with FlashQLA installed")

    @classmethod
    def on_this_gpu(cls, cfg) -> "Setting":
        import torch

        from fused_kernels import gated_delta_rule as gdr

        m = cfg.model
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        backend = gdr.gdn_backend(m.gdn_backend)  # raises, in one line, when a forced backend cannot run
        return cls(backend, m.gdn_pre_impl != "unfused", m.fused_mrope is not False, gdr.fla_unusable_reason() is None,
                   _qla_ctas(props.multi_processor_count) if backend == "flash_qla" else 0,
                   f"{props.name} ({props.multi_processor_count} SMs)")


def _qla_ctas(sms: int) -> int:
    """FlashQLA's own TARGET_NUM_CTAS where its forward module has one, else its rule."""
    try:
        import flash_qla.ops.gated_delta_rule.chunk as chunk

        return int(sys.modules[chunk.fused_gdr_fwd.__module__].TARGET_NUM_CTAS)
    except (ImportError, AttributeError, KeyError):
        return int(sms * QLA_CTA_SHARE)


@dataclass
class Job:
    """One warm-up call: ``runner`` (a function of multimodal/kernel_warmup.py) with ``kwargs``."""

    family: str
    label: str
    runner: str
    kwargs: dict = field(default_factory=dict)
    tuning: bool = True  # Triton autotune: run one at a time, on a GPU nothing else uses


def qla_block_dv(rows: int, heads: int, ctas: int) -> int:
    """FlashQLA 0.1.3's forward (hopper/fused_fwd.py): block_DV from sequences (or pieces) x heads."""
    grid = rows * heads
    return 128 if grid >= ctas else 64 if 2 * grid >= ctas else 32


def segments_of(seq: int, n: int) -> tuple[int, ...]:
    """A row of ``seq`` tokens cut into ``n`` samples of about equal length."""
    n = max(1, min(n, seq))
    base = seq // n
    return (base,) * (n - 1) + (seq - base * (n - 1),)


def unsplit_rows(seq: int, heads: int, ctas: int) -> list[tuple[int, tuple[int, ...]]]:
    """(block_DV, segments) for each block_DV a row of ``seq`` tokens reaches unsplit."""
    out = {}
    for n in sorted({1, math.ceil(ctas / (2 * heads)), math.ceil(ctas / heads)}):
        if n <= seq:
            out.setdefault(qla_block_dv(n, heads, ctas), segments_of(seq, n))
    return sorted(out.items())


def split_rows(seq: int, heads: int, ctas: int) -> list[tuple[int, int, int]]:
    """(block_DV, piece length in chunks, pieces) for each block_DV a one-sample row reaches when
    FlashQLA cuts it (fused_kernels/flash_qla_gdr.split_pieces: the forward sees the pieces)."""
    from fused_kernels.flash_qla_gdr import CHUNK

    chunks = math.ceil(seq / CHUNK)
    out = {}
    for max_chunks in range(chunks, 0, -1):
        pieces = math.ceil(chunks / max_chunks)
        out.setdefault(qla_block_dv(pieces, heads, ctas), (max_chunks, pieces))
    return sorted((block, mc, pieces) for block, (mc, pieces) in out.items())


def _qla_refusal(s: RankShapes) -> str | None:
    import torch

    from fused_kernels.flash_qla_gdr import shape_refusal

    dtype = getattr(torch, s.dtype)
    q = torch.empty(0, 0, 0, s.key_dim, dtype=dtype, device="meta")
    return shape_refusal(q, torch.empty(0, 0, 0, s.value_dim, dtype=dtype, device="meta"))


def _cu_rows(s: RankShapes) -> list[tuple[int, ...] | None]:
    """Rows for the kernels that search cu_seqlens: one per search depth reached (a few samples;
    more than 64, or the CUDA graphs' padded table); None for padded batches (no cu_seqlens)."""
    if not s.packed:
        return [None]
    entries = sorted({*CU_ENTRIES, s.graph_cu_entries or CU_ENTRIES[0]})
    seen, rows = set(), []
    for n in entries:
        bucket = max(64, 1 << (n - 1).bit_length())  # triton_support.cu_block
        if bucket not in seen and n - 1 <= s.seq:
            seen.add(bucket)
            rows.append(segments_of(s.seq, n - 1))
    return rows


def _cp_ranks(s: RankShapes) -> tuple[int, ...]:
    """CP ranks whose slices of A_log / dt_bias differ in 16-byte alignment (Triton compiles each
    alignment apart): rank 0 and the first rank whose slice starts off a 16-byte boundary."""
    if s.cp == 1:
        return (0,)
    size = 4 if s.dtype == "float32" else 2
    odd = next((r for r in range(1, s.cp) if r * s.heads * size % 16), None)
    return (0,) if odd is None else (0, odd)


def _rows_label(rows) -> str:
    return "dense" if rows == [None] else "rows of " + "/".join(str(len(r)) for r in rows) + " samples"


def plan(cfg, setting: Setting) -> list[Job]:
    """Every warm-up call this recipe's training step needs, on a machine resolving to ``setting``."""
    s = rank_shapes(cfg)
    common = dict(dtype=s.dtype, seq=s.seq, batch=s.batch)
    gdn = dict(common, key_dim=s.key_dim, value_dim=s.value_dim)
    head_str = f"{s.heads} heads of {s.key_dim}/{s.value_dim}, {s.dtype}"
    jobs = []
    # the pre-delta-rule chain (Qwen35GatedDeltaNet.prepare / prepare_heads)
    fused_pre = setting.fused_pre and s.conv_width == 4 and s.tp_value_heads % s.tp_key_heads == 0
    rows = _cu_rows(s)
    if setting.gdn_backend != "torch" and fused_pre:
        ranks = _cp_ranks(s)
        where = "in_proj output" if s.cp == 1 else f"cp head group, ranks {'/'.join(map(str, ranks))}"
        jobs.append(Job("pre_gdr", f"fwd+bwd, {s.key_heads} key / {head_str}, {where}, {_rows_label(rows)}",
                        "pre_gdr", dict(common, tp_key_heads=s.tp_key_heads, tp_value_heads=s.tp_value_heads,
                                        key_dim=s.key_dim, value_dim=s.value_dim, conv_width=s.conv_width,
                                        cp=s.cp, cp_ranks=ranks, rows=rows)))
    elif setting.gdn_backend in ("flash_qla", "fla") and setting.fla_usable:
        channels = s.key_heads * s.key_dim * 2 + s.heads * s.value_dim
        jobs.append(Job("conv1d", f"fla causal conv1d fwd+bwd, {channels} channels x {s.conv_width}, {s.dtype}, "
                        f"{_rows_label(rows[:1])}", "conv1d",
                        dict(common, channels=channels, width=s.conv_width, rows=rows[:1])))
    # the delta rule
    backend = setting.gdn_backend
    if backend == "flash_qla" and _qla_refusal(s) is not None:
        backend = "fla" if setting.fla_usable else "torch"  # what each call then runs (gated_delta_rule.py)
    if backend == "flash_qla":
        gdn["heads"] = s.heads
        if not s.packed:  # padded rows: no cu_seqlens, no split; block_DV from rows x heads
            block = qla_block_dv(s.batch, s.heads, setting.qla_ctas)
            jobs.append(Job("flash_qla", f"fwd+bwd, {head_str}, {s.batch} dense rows (block_DV {block})",
                            "flash_qla", dict(gdn, segments=None, max_chunks=None), tuning=False))
        else:
            for block, segments in unsplit_rows(s.seq, s.heads, setting.qla_ctas):
                jobs.append(Job("flash_qla", f"fwd+bwd, {head_str}, a row of {len(segments)} samples "
                                f"(block_DV {block})", "flash_qla", dict(gdn, segments=segments, max_chunks=None),
                                tuning=False))
            # FlashQLA's intra-card split: kernels of its own, and the pieces set block_DV
            for block, max_chunks, pieces in split_rows(s.seq, s.heads, setting.qla_ctas):
                jobs.append(Job("flash_qla", f"fwd+bwd, {head_str}, one sample cut into {pieces} pieces "
                                f"(block_DV {block})", "flash_qla",
                                dict(gdn, segments=(s.seq,), max_chunks=max_chunks), tuning=False))
    elif backend == "fla":
        save = bool(cfg.model.gdn_save_states)
        jobs.append(Job("fla", f"fwd+bwd{' (saved states)' if save else ''}, {head_str}, {_rows_label(rows[:1])}",
                        "fla", dict(gdn, heads=s.heads, segments=rows[0], save_states=save)))
    if setting.fused_mrope:
        jobs.append(Job("mrope", f"decoder q/k fwd+bwd, {s.attn_heads} q / {s.attn_kv_heads} kv heads of "
                        f"{s.head_dim} (rotary {s.rot_dim}), {s.dtype}", "mrope_attention",
                        dict(tokens=s.attn_tokens, batch=s.batch, heads=s.attn_heads, kv_heads=s.attn_kv_heads,
                             head_dim=s.head_dim, rot_dim=s.rot_dim, theta=s.rope_theta, section=s.mrope_section,
                             interleaved=s.mrope_interleaved, dtype=s.dtype)))
        jobs.append(Job("mrope", f"vision 2-D rotary fwd+bwd, {s.vision_heads} heads of {s.vision_head_dim}, "
                        f"{s.dtype}", "vision_rotary",
                        dict(patches=VISION_PATCHES, heads=s.vision_heads, head_dim=s.vision_head_dim,
                             theta=s.vision_rope_theta, dtype=s.dtype)))
    return jobs


# ----------------------------------------------------------------------------- running


def _devices(count: int, jobs: list[Job]) -> tuple[int, list[int]]:
    """The tuning process's GPU and each parallel job's: with several GPUs the autotuner gets GPU 0
    to itself and the TileLang jobs share the others."""
    parallel = [j for j in jobs if not j.tuning]
    if count <= 1:
        return 0, [0] * len(parallel)
    return 0, [1 + i % (count - 1) for i in range(len(parallel))]


def _cache_files(folder: str | None) -> int:
    if not folder or not Path(folder).is_dir():
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


def _calls(jobs: list[Job]) -> list[tuple[str, dict]]:
    return [(job.runner, job.kwargs) for job in jobs]


def run(jobs: list[Job], processes: int) -> list[tuple[Job, float, float, str | None]]:
    """Each job's (start, end, error): parallel jobs in a pool of ``processes``, the tuning jobs
    one after another in one more process, all started together."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import torch

    from multimodal import kernel_warmup

    tuning = [j for j in jobs if j.tuning]
    parallel = [j for j in jobs if not j.tuning]
    tune_device, devices = _devices(torch.cuda.device_count(), jobs)
    workers = max(1, min(processes, len(parallel))) + (1 if tuning else 0)
    results = []
    # spawn: each worker gets a CUDA context of its own (a forked one cannot use the parent's)
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        futures = []
        if tuning:
            futures.append((tuning, pool.submit(kernel_warmup.run_jobs, _calls(tuning), tune_device)))
        futures += [([job], pool.submit(kernel_warmup.run_jobs, _calls([job]), dev))
                    for job, dev in zip(parallel, devices)]
        for batch, future in futures:
            try:
                done = future.result()
            except Exception as e:  # the worker died (a crash inside a kernel, out of memory on the host)
                now = time.time()
                done = [(now, now, f"worker process failed: {one_line(e) or type(e).__name__}")] * len(batch)
            results += [(job, *r) for job, r in zip(batch, done)]
    return results


def summary(results, started: float, before: dict[str, int], after: dict[str, int]) -> list[str]:
    """One line per kernel family (its jobs, its span from first start to last end), the total."""
    lines = []
    for family in FAMILIES:
        mine = [r for r in results if r[0].family == family]
        if not mine:
            continue
        span = max(r[2] for r in mine) - min(r[1] for r in mine)
        failed = sum(r[3] is not None for r in mine)
        how = "in parallel" if not mine[0][0].tuning else "one after another"
        state = f", {failed} FAILED" if failed else ""
        lines.append(f"  {family:<10} {len(mine):>2} shape{'s' if len(mine) > 1 else ' '} fwd+bwd {how:<17} "
                     f"{span:7.1f} s{state}")
    added = ", ".join(f"+{after[k] - before[k]} {k}" for k in before) or "folders not known"
    lines.append(f"  total {time.time() - started:.1f} s ({len(results)} warm-up calls); new cache files: {added}")
    return lines


def _print_plan(jobs: list[Job], setting: Setting, shapes: RankShapes, config: str) -> None:
    print(f"warm_kernels plan for {config} ({setting.device}; GDN backend {setting.gdn_backend})")
    print(f"  per rank: {shapes.describe()}")
    for job in jobs:
        print(f"  {job.family:<10} {'one at a time' if job.tuning else 'parallel':<13} {job.label}")
    if not jobs:
        print("  nothing to compile: every kernel of this recipe runs its PyTorch path")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML recipe under configs/")
    ap.add_argument("--dry-list", action="store_true", help="print the warm-up plan and exit (no GPU needed)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="parallel compile processes (default: one per TileLang job, at most half the CPUs)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, the same as training's, e.g. parallel.tp=2")
    args = ap.parse_intermixed_args(argv)
    from multimodal.config import load_config, resolve_sources, validate_layout

    if not args.dry_list:
        import torch

        if not torch.cuda.is_available():
            print("error: multimodal.warm_kernels needs a CUDA GPU; none is visible here (torch.cuda.is_available() "
                  "is False): run it on the GPU node, or add --dry-list to print the plan", file=sys.stderr)
            return 2
    try:
        cfg = resolve_sources(load_config(args.config, args.overrides))
        validate_layout(cfg.model, cfg.parallel)
        shapes = rank_shapes(cfg)
        if args.dry_list:
            setting = Setting.assumed(cfg)
            _print_plan(plan(cfg, setting), setting, shapes, args.config)
            return 0
        return _warm(cfg, shapes, args)
    except TrainingError as e:
        print(f"{e.label}: {one_line(e)}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:  # gdn_backend: a forced backend that cannot run here
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2


def _warm(cfg, shapes: RankShapes, args) -> int:
    from core.kernel_cache import describe, use_kernel_cache

    started = time.time()
    if cfg.train.kernel_cache:  # before anything compiles; the worker processes inherit it
        print(describe(use_kernel_cache(cfg.train.kernel_cache), cfg.train.kernel_cache))
    else:
        print("kernel cache: train.kernel_cache=null, each library's own folder")
    folders = {name: os.environ[var] for name, var in (("TileLang", "TILELANG_CACHE_DIR"), ("Triton", "TRITON_CACHE_DIR"))
               if os.environ.get(var)}
    setting = Setting.on_this_gpu(cfg)
    jobs = plan(cfg, setting)
    _print_plan(jobs, setting, shapes, args.config)
    if not jobs:
        return 0
    before = {k: _cache_files(v) for k, v in folders.items()}
    compile_jobs = sum(not j.tuning for j in jobs)
    processes = args.jobs or max(1, min(compile_jobs, (os.cpu_count() or 2) // 2))
    results = run(jobs, processes)
    after = {k: _cache_files(v) for k, v in folders.items()}
    for job, _, _, error in results:
        if error is not None:
            print(f"  FAILED {job.family}: {job.label}: {error}", file=sys.stderr)
    print("compiled:")
    print("\n".join(summary(results, started, before, after)))
    return 1 if any(r[3] is not None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
