"""GPU check of the grouped-GEMM experts: torch's grouped GEMM and the weighted SwiGLU kernel against
their references (bf16, empty experts included), GroupedExperts against megatron's SequentialMLP,
the time of one forward + backward of each at a real layer's shapes, and the main_grad
accumulate kernel against torch's add_ (bit-exact, and the bandwidth of each).

    python tests/gpu/test_grouped_experts_gpu.py [--experts 256 --tokens 8192 --topk 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


import pytest
import torch  # noqa: E402

from fused_kernels import fused_swiglu as fs  # noqa: E402
from fused_kernels import main_grad_accumulate as mga  # noqa: E402
from fused_kernels.grouped_gemm import grouped_mm, grouped_mm_reference  # noqa: E402
from scripts.bench_fp8_experts import skewed_counts as _counts  # noqa: E402
from scripts.bench_fp8_experts import time_ms  # noqa: E402


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_gemm(experts: int, rows: int, h: int, f: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    counts = _counts(rows, experts, gen)
    offs = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, 2 * f, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    g = torch.randn(rows, 2 * f, device="cuda", dtype=torch.bfloat16)
    fwd = _rel(grouped_mm(x, w.mT, offs), grouped_mm_reference(x, w.mT, offs))
    wgrad_raw = torch._grouped_mm(g.mT, x, offs=offs)
    empty = (counts == 0).cuda()
    raw_zero = bool((wgrad_raw[empty] == 0).all()) if empty.any() else None
    wgrad = _rel(grouped_mm(g.mT, x, offs), grouped_mm_reference(g.mT, x, offs))
    return {"experts": experts, "rows": rows, "empty_experts": int(empty.sum()), "fwd_rel_err": fwd,
            "wgrad_rel_err": wgrad, "torch_zeroes_empty_wgrad_groups": raw_zero,
            "ok": fwd < 1e-2 and wgrad < 1e-2 and raw_zero is not False}


def check_act(rows: int, f: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(rows, 2 * f, device="cuda", dtype=dtype)
        p = torch.rand(rows, device="cuda", dtype=torch.float32)
        g = torch.randn(rows, f, device="cuda", dtype=dtype)
        dy, dp = fs.weighted_swiglu_backward(g, y, p)
        rdy, rdp = fs.weighted_swiglu_back_reference(g, y, p)
        out[str(dtype)[6:]] = {"fwd": _rel(fs.weighted_swiglu_forward(y, p), fs.weighted_swiglu_reference(y, p)),
                               "dy": _rel(dy, rdy), "dp": _rel(dp, rdp)}
    out["ok"] = all(v < (1e-5 if k == "float32" else 1e-2) for k, d in out.items() if k != "ok" for v in d.values())
    return out


def check_accumulate(numel: int) -> dict:
    """The main_grad accumulate kernel against torch's add_ (bit-exact) and the bandwidth of each."""
    main = torch.randn(numel, device="cuda")
    grad = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    ref = main.clone()
    mga.accumulate_reference(ref, grad)
    ours = main.clone()
    mga.accumulate_(ours, grad)
    gb = numel * 10 / 1e9  # fp32 read + write, bf16 read
    kernel_ms, add_ms = time_ms(lambda: mga.accumulate_(main, grad), reps=5), time_ms(lambda: main.add_(grad), reps=5)
    return {"numel": numel, "bit_exact": bool(torch.equal(ours, ref)), "kernel_ms": kernel_ms,
            "torch_add_ms": add_ms, "kernel_tb_per_s": gb / kernel_ms, "torch_add_tb_per_s": gb / add_ms,
            "ok": bool(torch.equal(ours, ref))}


def check_module(experts: int, tokens: int, topk: int, h: int, f: int) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.common.grouped_experts import GroupedExperts
    from multimodal.platform import init_distributed

    init_distributed()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=8, ffn_hidden_size=f,
                            moe_ffn_hidden_size=f, num_moe_experts=experts, moe_router_topk=topk,
                            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                            add_bias_linear=False, bias_activation_fusion=True, params_dtype=torch.bfloat16,
                            bf16=True)
    pgs = get_default_pg_collection()
    grouped = GroupedExperts(experts, cfg, pg_collection=pgs)
    backend = LocalSpecProvider()
    seq = SequentialMLP(experts, cfg, MLPSubmodules(linear_fc1=backend.column_parallel_linear(),
                                                    linear_fc2=backend.row_parallel_linear()), pg_collection=pgs)
    with torch.no_grad():
        for e, expert in enumerate(seq.local_experts):
            expert.linear_fc1.weight.copy_(grouped.linear_fc1.weight[e])
            expert.linear_fc2.weight.copy_(grouped.linear_fc2.weight[e])
    gen = torch.Generator().manual_seed(1)
    rows = tokens * topk
    counts = _counts(rows, experts, gen)
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    p = torch.rand(rows, device="cuda")
    grad = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)

    def step(module, c):
        xi, pi = x.clone().requires_grad_(), p.clone().requires_grad_()
        out, _ = module(xi, c, pi)
        out.backward(grad)
        return out, xi.grad, pi.grad

    res_g = step(grouped, counts.cuda())
    res_s = step(seq, counts)
    errs = {name: _rel(a, b) for name, a, b in zip(("out", "dx", "dprobs"), res_g, res_s)}
    wg = grouped.linear_fc1.weight.grad
    ws = torch.stack([e.linear_fc1.weight.grad if e.linear_fc1.weight.grad is not None
                      else torch.zeros_like(e.linear_fc1.weight) for e in seq.local_experts])
    errs["dw1"] = _rel(wg, ws)
    ms_g = time_ms(lambda: step(grouped, counts.cuda()), reps=5)
    ms_s = time_ms(lambda: step(seq, counts), reps=2)
    flop = 6 * rows * h * 3 * f  # fc1 (2F) + fc2 (F), forward + backward
    return {"experts": experts, "tokens": tokens, "topk": topk, "rel_err_vs_sequential": errs,
            "ok": all(v < 2e-2 for v in errs.values()),
            "grouped_ms": ms_g, "sequential_ms": ms_s, "grouped_tflops": flop / ms_g / 1e9,
            "sequential_tflops": flop / ms_s / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--json")
    a = ap.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "gemm": check_gemm(a.experts, a.tokens * a.topk, a.hidden, a.ffn),
              "act": check_act(a.tokens * a.topk, a.ffn),
              "module": check_module(a.experts, a.tokens, a.topk, a.hidden, a.ffn),
              # one layer's fc1 weight gradient of the 35B-A3B shapes
              "accumulate": check_accumulate(a.experts * 2 * a.ffn * a.hidden)}
    result["ok"] = all(result[k]["ok"] for k in ("gemm", "act", "module", "accumulate"))
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if result["ok"] else 1)


@pytest.mark.gpu
def test_grouped_experts_match_their_references(run_check):
    """Grouped GEMM, weighted SwiGLU, GroupedExperts vs SequentialMLP and the main_grad accumulate kernel."""
    run_check(__file__)


if __name__ == "__main__":
    main()
