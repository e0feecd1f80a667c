"""Step profiler for the training loop: where the time of a step goes.

``logging.profile_step=N`` (0 = off) runs ``torch.profiler`` over steps
``N .. N + logging.profile_num_steps - 1`` (and step N - 1, traced as a warm-up and not
summarized) on the ranks in ``logging.profile_ranks`` and writes, under ``<logging.dir>/profile/``:

- ``trace_rank{r}.json.gz``: the full timeline (open in https://ui.perfetto.dev or
  chrome://tracing; TensorBoard's profiler plugin reads it too);
- ``kernels_rank{r}.txt`` / ``.json``: per profiled step, the device time by kernel (top N, each
  with its top launch sites: which code to change to remove it) and
  by category (GEMM, attention, linear attention, NCCL, optimizer, elementwise, ...), and how
  much of the wall time the GPU was busy at all (the rest is launch overhead, host syncs or
  data waits), and the GPU's idle gaps charged to the host op that launched the kernel ending
  each gap (where the host was too slow to keep the GPU fed); the longest gaps one by one, with
  the host call chain that launched the kernel ending each (Python frames included with
  ``logging.profile_with_stack=true``).

The summary is computed from the exported trace itself (kernel events and their durations),
which keeps it independent of the profiler's Python API, whose field names have changed
across torch releases. On CPU there are no kernels; the summary then ranks CPU operators by
self time, which is what a CPU run spends its time in.

Profiling costs time (the profiler records every launch), so the profiled steps' own timings
in metrics.jsonl are not representative; the trace's relative figures are.
"""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import re
from collections import defaultdict
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TOP_N = 60
WARMUP_PREFIX = "ProfilerWarmup#"  # the traced step before the profiled ones, not summarized
LONGEST_GAPS = 12   # idle gaps listed one by one, with their launch's call chain
CHAIN_DEPTH = 25    # innermost frames of each chain printed

# First match wins; names are CUDA kernel names (cuBLAS/CUTLASS, flash-attention, Triton
# kernels of flash-linear-attention and of ours, tilelang, NCCL, PyTorch's own kernels).
CATEGORIES = [
    ("nccl", r"nccl"),
    ("memcpy/memset", r"^Memcpy|^Memset|memcpy|memset"),
    ("ours: fused triton", r"mrope|pre_gdr|linear_ce|_lce_"),
    ("attention (flash)", r"flash|fmha|attention|_attn_"),
    # fla's Triton and TileLang kernels and FlashQLA's (``*_gdr_*``); ``kernel_kernel`` is what
    # TileLang names fla 0.6.0's dqkwg backward kernel (2B profiles: 18 per step, one per GDN layer)
    ("linear attention (fla/tilelang)", r"chunk_|delta|kkt|solve_tril|recompute_w_u|causal_conv1d|l2norm"
                                        r"|cumsum_|tilelang|^main_kernel|gated_delta|_gdn|wy_repr|_gdr|^kernel_kernel$"),
    ("gemm", r"gemm|cutlass|cublas|nvjet|sm90_xmma|sm80_xmma|_xmma_|matmul|wgmma|splitk"),
    ("optimizer", r"multi_tensor|adam|fused_adam|_foreach|foreach"),
    ("softmax/norm", r"softmax|layer_norm|rms_norm|norm_kernel|batch_norm"),
    ("reduction", r"reduce_kernel|reduction|argmax|cub::|radix|sum_kernel"),
    ("index/scatter/gather", r"index|scatter|gather|embedding|masked|where"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|cat_|arange|triu|tril"),
    ("triton (other)", r"^triton_|_kernel$"),
]
_CAT_RE = [(name, re.compile(pat, re.IGNORECASE)) for name, pat in CATEGORIES]
_KERNEL_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def categorize(kernel_name: str) -> str:
    for name, pattern in _CAT_RE:
        if pattern.search(kernel_name):
            return name
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time at least one kernel was running
    (kernels on several streams overlap; summing their durations would overcount)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


GAP_US = 20.0  # idle stretches shorter than this are the normal launch-to-launch spacing
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


class _Launchers:
    """For a kernel, the top-level host op whose call launched it (the outermost CPU op on the
    launching thread, e.g. an autograd Function, ``aten::linear`` or a backward node), found
    through the correlation id the trace gives both the launch call and the kernel."""

    def __init__(self, events: list[dict]):
        self.launch = {e["args"]["correlation"]: e for e in events
                       if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
        ops: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "cpu_op" and not str(e["name"]).startswith("ProfilerStep#"):
                ops[e.get("tid", 0)].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        self.top: dict[int, tuple[list[float], list[tuple[float, float, str]]]] = {}
        for tid, spans in ops.items():
            spans.sort(key=lambda x: (x[0], -x[1]))
            top, end = [], float("-inf")
            for a, b, name in spans:
                if a >= end:  # not inside the previous top-level op
                    top.append((a, b, name))
                    end = b
            self.top[tid] = ([a for a, _, _ in top], top)

        # every host span per thread (cpu ops, and Python frames when profiled with stacks), for
        # the call chain of the longest gaps' launches
        self.spans: dict[int, list[tuple[float, float, str, str]]] = defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function"):
                self.spans[e.get("tid", 0)].append((e["ts"], e["ts"] + e["dur"], str(e["name"]), e["cat"]))

    def _launch_of(self, kernel: dict) -> dict | None:
        return self.launch.get(kernel.get("args", {}).get("correlation"))

    def chain(self, kernel: dict) -> list[str]:
        """The host spans enclosing the kernel's launch, outermost first: with
        ``logging.profile_with_stack`` these include the Python frames, i.e. which code launched it."""
        launch = self._launch_of(kernel)
        if launch is None:
            return []
        ts = launch["ts"]
        inside = [(a, -b, name) for a, b, name, _ in self.spans.get(launch.get("tid", 0), ()) if a <= ts <= b]
        return [name for _, _, name in sorted(inside)]

    def sites(self, kernels: list[dict]) -> list[str]:
        """Where each kernel was launched, as one line: the innermost Python frame outside torch
        (with ``logging.profile_with_stack``), the top-level host op and the innermost one, e.g.
        ``megatron/core/distributed/...py(380): hook | aten::add_``. Which code to change to remove a
        kernel. One sweep per launching thread (host spans nest, so the enclosing ones are a stack)."""
        out = ["(launch not in trace)"] * len(kernels)
        queries: dict[int, list[tuple[float, int]]] = defaultdict(list)
        for i, k in enumerate(kernels):
            launch = self._launch_of(k)
            if launch is not None:
                queries[launch.get("tid", 0)].append((launch["ts"], i))
        for tid, wanted in queries.items():
            spans = sorted(self.spans.get(tid, ()), key=lambda x: (x[0], -x[1]))
            stack, j = [], 0
            for ts, i in sorted(wanted):
                while j < len(spans) and spans[j][0] <= ts:
                    while stack and stack[-1][1] < spans[j][0]:
                        stack.pop()
                    stack.append(spans[j])
                    j += 1
                while stack and stack[-1][1] < ts:
                    stack.pop()
                out[i] = _site([s for s in stack if s[0] <= ts <= s[1]])
        return out

    def launch_ts(self, kernel: dict) -> float | None:
        launch = self._launch_of(kernel)
        return None if launch is None else launch["ts"]

    def op_of(self, kernel: dict) -> str:
        launch = self._launch_of(kernel)
        if launch is None or launch.get("tid", 0) not in self.top:
            return "(launch not in trace)"
        starts, top = self.top[launch.get("tid", 0)]
        i = bisect.bisect_right(starts, launch["ts"]) - 1
        if i >= 0 and top[i][1] >= launch["ts"]:
            return top[i][2]
        return "(outside any op)"


def _site(enclosing: list[tuple]) -> str:
    """One line from the host spans around a launch, outermost first (see ``_Launchers.sites``)."""
    ops = [name for _, _, name, cat in enclosing if cat == "cpu_op"]
    frames = [name for _, _, name, cat in enclosing if cat == "python_function"
              and not name.startswith(("torch/", "<built-in", "threading.py", "contextlib.py"))]
    parts = [frames[-1]] if frames else []
    if ops:
        parts += [ops[0]] if len(ops) == 1 else [ops[0], ops[-1]]
    return " | ".join(parts) or "(outside any op)"


def _by_site(kernels: list[dict], sites: list[str], top: int = 3) -> dict[str, list[dict]]:
    """Per kernel name, its ``top`` launch sites by device time."""
    agg: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for k, site in zip(kernels, sites):
        a = agg[k["name"]][site]
        a[0] += k["dur"]
        a[1] += 1
    return {name: [{"site": site, "ms": us / 1e3, "calls": n}
                   for site, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]]
            for name, per in agg.items()}


def _idle_gaps(mine: list[dict], launchers: _Launchers, top_n: int,
               busy_until: float) -> tuple[float, list[dict], list[dict]]:
    """GPU idle stretches over GAP_US between a step's kernels (and from ``busy_until``, where the
    step's device time starts, to its first kernel), each charged to the host op that launched
    the kernel ending it: what the GPU was waiting for the host to get to. Also the LONGEST_GAPS
    longest ones, each with the kernels around it and the launch's call chain."""
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total, prev, found = 0.0, {"name": "(the step's start)"}, []
    for k in sorted(mine, key=lambda k: k["ts"]):
        if k["ts"] - busy_until > GAP_US:
            gap = k["ts"] - busy_until
            agg = by_op[launchers.op_of(k)]
            agg[0] += gap
            agg[1] += 1
            total += gap
            found.append((gap, prev, k))
        end = k["ts"] + k["dur"]
        busy_until = max(busy_until, end)
        prev = k
    top = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top_n]
    longest = [{"us": gap, "after": p["name"], "before": k["name"], "chain": launchers.chain(k)}
               for gap, p, k in sorted(found, key=lambda f: -f[0])[:LONGEST_GAPS]]
    return total, [{"op": op, "ms": us / 1e3, "gaps": n} for op, (us, n) in top], longest


def summarize_trace(events: list[dict], top_n: int = TOP_N) -> list[dict]:
    """One summary per ``ProfilerStep#k`` in a chrome trace: wall time, device-busy time,
    device time by category and the top kernels.

    A kernel belongs to the step whose host span launched it (through the launch's correlation
    id; a kernel without one, to the span it starts in): with the host ahead of the GPU, a step's
    kernels run on after its host span and the previous step's still run inside it. A step's
    device time starts when the previous step's last kernel ends (or at its host span's start, if
    the GPU was already idle then) and ends with its own last kernel. ``ProfilerWarmup#k`` spans
    (the step before the first profiled one, see StepProfiler) only provide that previous end."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("user_annotation", "cpu_op")
                   and str(e.get("name", "")).startswith(("ProfilerStep#", WARMUP_PREFIX)))
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in _KERNEL_CATS]
    launchers = _Launchers(events)
    span_starts = [a for a, _, _ in spans]
    by_span: dict[int, list[dict]] = defaultdict(list)
    for k in kernels:
        t = launchers.launch_ts(k)
        i = bisect.bisect_right(span_starts, k["ts"] if t is None else t) - 1
        if i >= 0:
            by_span[i].append(k)
    out, prev_end = [], None
    for i, (start, end, name) in enumerate(spans):
        mine = by_span[i]
        ends = [k["ts"] + k["dur"] for k in mine]
        if name.startswith(WARMUP_PREFIX):
            prev_end = max(ends, default=prev_end)
            continue
        wall_start = start if prev_end is None else max(start, prev_end)
        wall_end = max([end] + ends)
        prev_end = max(ends, default=prev_end)
        by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        by_cat: dict[str, float] = defaultdict(float)
        for k in mine:
            agg = by_kernel[k["name"]]
            agg[0] += k["dur"]
            agg[1] += 1
            by_cat[categorize(k["name"])] += k["dur"]
        kernel_us = sum(v[0] for v in by_kernel.values())
        busy_us = _union_us([(k["ts"], k["ts"] + k["dur"]) for k in mine])
        wall_us = wall_end - wall_start
        top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top_n]
        gap_us, gaps, longest = _idle_gaps(mine, launchers, top_n, busy_until=wall_start)
        sites = _by_site(mine, launchers.sites(mine))
        out.append({
            "step": name,
            "wall_ms": wall_us / 1e3,
            "device_busy_ms": busy_us / 1e3,
            "device_idle_fraction": 1.0 - busy_us / wall_us if wall_us > 0 else None,
            "kernel_ms": kernel_us / 1e3,
            "num_kernels": len(mine),
            "categories": [{"category": c, "ms": us / 1e3, "fraction": us / kernel_us if kernel_us else 0.0}
                           for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])],
            "top_kernels": [{"kernel": n, "ms": us / 1e3, "calls": calls, "category": categorize(n),
                             "fraction": us / kernel_us if kernel_us else 0.0, "sites": sites[n]}
                            for n, (us, calls) in top],
            "idle_gaps_ms": gap_us / 1e3,
            "idle_gaps_by_launching_op": gaps,
            "longest_idle_gaps": longest,
        })
    return out


def summarize_cpu_ops(prof, top_n: int = TOP_N) -> list[dict]:
    """CPU-only runs: operators by self CPU time over all profiled steps."""
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()
            if not e.key.startswith("ProfilerStep")]
    total = sum(r[1] for r in rows) or 1.0
    top = sorted(rows, key=lambda r: -r[1])[:top_n]
    return [{"step": "all profiled steps (CPU operators, self time)", "self_cpu_ms": total / 1e3,
             "top_ops": [{"op": k, "ms": us / 1e3, "calls": n, "fraction": us / total} for k, us, n in top]}]


def format_summary(summary: list[dict]) -> str:
    lines = []
    for s in summary:
        if "top_ops" in s:
            lines.append(f"== {s['step']}: {s['self_cpu_ms']:.1f} ms")
            lines += [f"  {o['ms']:10.2f} ms {100 * o['fraction']:5.1f}% {o['calls']:6d}x  {o['op']}" for o in s["top_ops"]]
            continue
        idle = s["device_idle_fraction"]
        lines.append(f"== {s['step']}: wall {s['wall_ms']:.1f} ms, device busy {s['device_busy_ms']:.1f} ms "
                     f"(idle {100 * idle:.1f}%), {s['num_kernels']} kernels, kernel time {s['kernel_ms']:.1f} ms")
        lines.append("  by category:")
        lines += [f"    {c['ms']:10.2f} ms {100 * c['fraction']:5.1f}%  {c['category']}" for c in s["categories"]]
        lines.append("  top kernels (under each, its top launch sites: Python frame | top-level op | innermost op):")
        for k in s["top_kernels"]:
            lines.append(f"    {k['ms']:10.2f} ms {100 * k['fraction']:5.1f}% {k['calls']:6d}x  [{k['category']}] "
                         f"{k['kernel'][:140]}")
            lines += [f"        {x['ms']:8.2f} ms {x['calls']:6d}x  {x['site'][:160]}" for x in k.get("sites", ())]
        lines.append(f"  GPU idle gaps > {GAP_US:g} us: {s['idle_gaps_ms']:.1f} ms, by the host op that launched "
                     "the kernel ending each gap:")
        lines += [f"    {g['ms']:10.2f} ms {g['gaps']:6d} gaps  {g['op'][:140]}" for g in s["idle_gaps_by_launching_op"]]
        if s.get("longest_idle_gaps"):
            lines.append("  longest idle gaps (kernel before -> kernel after; the launch's host call chain, outermost first):")
            for g in s["longest_idle_gaps"]:
                lines.append(f"    {g['us']:8.1f} us  {g['after'][:70]} -> {g['before'][:70]}")
                lines += [f"        {name[:150]}" for name in g["chain"][-CHAIN_DEPTH:]]
    return "\n".join(lines) + "\n"


class StepProfiler:
    """Wraps the training loop's steps: ``begin(it)`` before a step, ``end(it)`` after it."""

    def __init__(self, logging_cfg, rank: int, is_cuda: bool):
        self.first = int(logging_cfg.profile_step)
        self.last = self.first + int(logging_cfg.profile_num_steps) - 1
        self.enabled = self.first > 0 and rank in list(logging_cfg.profile_ranks)
        self.dir = Path(logging_cfg.dir) / "profile"
        self.rank, self.is_cuda = rank, is_cuda
        self.with_stack = bool(logging_cfg.profile_with_stack)
        self.prof = None
        self.summary: list[dict] | None = None

    def _traced(self, it: int) -> bool:
        return it == self.first - 1 or self.first <= it <= self.last

    def begin(self, it: int) -> None:
        """The profiler starts one step early (``ProfilerWarmup#``, traced, not summarized):
        starting it costs host time while the GPU runs dry, which would otherwise land in the
        first profiled step as idle gaps before its first launches."""
        if not self.enabled or not self._traced(it):
            return
        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.is_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=False,
                                               with_stack=self.with_stack)
            self.prof.__enter__()
        label = f"{WARMUP_PREFIX}{it}" if it < self.first else f"ProfilerStep#{it}"
        self._step_ctx = torch.profiler.record_function(label)
        self._step_ctx.__enter__()

    def end(self, it: int) -> None:
        if self.prof is None or not self._traced(it):
            return
        self._step_ctx.__exit__(None, None, None)
        if it == self.last:
            self._finish()

    def close(self) -> None:
        """End an unfinished profile (training stopped inside the window)."""
        if self.prof is not None:
            self._finish()

    def _finish(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        raw = self.dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text()).get("traceEvents", [])
        with gzip.open(self.dir / f"trace_rank{self.rank}.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)
        raw.unlink()
        has_kernels = any(e.get("cat") in _KERNEL_CATS for e in events)
        self.summary = summarize_trace(events) if has_kernels else summarize_cpu_ops(prof)
        (self.dir / f"kernels_rank{self.rank}.json").write_text(json.dumps(self.summary, indent=1))
        text = format_summary(self.summary)
        (self.dir / f"kernels_rank{self.rank}.txt").write_text(text)
        log.info("profile of steps %d-%d written to %s\n%s", self.first, self.last, self.dir, text)
