"""Time one routed-experts layer's forward + backward (fc1, weighted SwiGLU, fc2 and the four grouped
GEMMs' gradients) in bf16 and under train.fp8, with the weight gradient's FP8 operands quantized by
the fused kernels (fused_kernels/fp8_token_groups.py) and by torch ops, at a real layer's shapes, and
where each path's GPU time goes (its kernels by GPU time, from one profiled call).

    python scripts/bench_fp8_experts.py [--experts 64 --tokens 8192 --topk 8 --hidden 2048 --ffn 512] [--balanced] [--json OUT]

The routing is skewed (a quarter of the experts empty, one holding about half the rows), the hard
case for kernels that split work by expert, or with ``--balanced`` the same count for every expert.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fused_kernels import fp8_token_groups  # noqa: E402
from fused_kernels.grouped_gemm import grouped_mm  # noqa: E402
from models.common import fp8  # noqa: E402
from models.common.grouped_experts import _ExpertMLP  # noqa: E402


def skewed_counts(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    weights = torch.rand(experts, generator=gen) ** 3
    weights[torch.randperm(experts, generator=gen)[: experts // 4]] = 0
    weights[0] += weights.sum()
    counts = torch.floor(weights / weights.sum() * rows).long()
    counts[0] += rows - counts.sum()
    return counts


def time_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    """Milliseconds per call of ``fn``: wall time over ``reps`` calls after ``warmup``, synchronized."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def kernel_table(fn, top: int = 12) -> dict:
    """One call of ``fn`` under the profiler: its kernel count, GPU microseconds, and the ``top``
    kernels by GPU time ([name, calls, total us]), where a path's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = by_name.setdefault(e.name[:120], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time_total
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"kernels": sum(calls for calls, _ in by_name.values()),
            "gpu_us": round(sum(us for _, us in by_name.values()), 1),
            "top": [[name, calls, round(us, 1)] for name, (calls, us) in ranked[:top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--balanced", action="store_true", help="every expert gets the same number of rows")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    rows = a.tokens * a.topk
    counts = torch.full((a.experts,), rows // a.experts) if a.balanced else skewed_counts(rows, a.experts, gen)
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, a.hidden, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(rows, device="cuda")
    w1 = (torch.randn(a.experts, 2 * a.ffn, a.hidden, device="cuda") / a.hidden**0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(a.experts, a.hidden, a.ffn, device="cuda") / a.ffn**0.5).bfloat16().requires_grad_()
    grad = torch.randn(rows, a.hidden, device="cuda", dtype=torch.bfloat16)

    def layer(gemm):
        def run():
            xi = x.detach().requires_grad_()
            out = _ExpertMLP.apply(xi, w1, w2, probs, offs, False, gemm, gemm)
            out.backward(grad)
            w1.grad = w2.grad = None
        return run

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "experts": a.experts,
              "routing": "balanced" if a.balanced else "skewed",
              "rows": rows, "hidden": a.hidden, "ffn": a.ffn}
    result["bf16_ms"] = time_ms(layer(grouped_mm))
    result["fp8_fused_ms"] = time_ms(layer(fp8.grouped_mm))
    available = fp8_token_groups.available
    fp8_token_groups.available = lambda t: "benchmark: torch-op quantization"
    try:
        result["fp8_torch_ops_ms"] = time_ms(layer(fp8.grouped_mm), reps=3)
    finally:
        fp8_token_groups.available = available
    # the weight gradient's quantization alone: both operands of dW2 (g [N, H], act [N, F])
    new_offs, width = fp8_token_groups.padded_offsets(offs, rows)
    act = torch.randn(rows, a.ffn, device="cuda", dtype=torch.bfloat16)

    def quantize_both():
        for t in (grad, act):
            amax = fp8_token_groups.group_amax(t, offs)
            fp8_token_groups.cast_groups_transposed(t, offs, new_offs, width, 448.0 / amax.clamp(min=1e-12),
                                                    torch.float8_e4m3fn)
    result["wgrad_quantize_ms"] = time_ms(quantize_both)
    moved = rows * (a.hidden + a.ffn) * (2 + 2 + 1)  # bf16 read twice (amax, cast), fp8 written once
    result["wgrad_quantize_gb_per_s"] = moved / result["wgrad_quantize_ms"] / 1e6
    for name, gemm in (("bf16", grouped_mm), ("fp8_fused", fp8.grouped_mm)):
        result[f"{name}_kernel_table"] = kernel_table(layer(gemm))
    result["fp8_speedup_fused"] = result["bf16_ms"] / result["fp8_fused_ms"]
    result["fp8_speedup_torch_ops"] = result["bf16_ms"] / result["fp8_torch_ops_ms"]
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
