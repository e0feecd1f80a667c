"""flash-linear-attention's GDN with the trainer's precomputed varlen table vs fla building it itself.

    python tests/gpu/test_gdn_varlen_gpu.py [--json OUT]

Same inputs (bf16, the 2B recipe's 16 value heads of 128, an 8K packed row of several samples),
both ways: the outputs and every input gradient must be bit-identical (the kernels are the same,
only where the chunk table comes from differs). Then the time per forward+backward call, the
GPU queue drained before and after each measured loop: the host time the table construction
(about fifteen small kernels and a sync per call) costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest
import torch


from fused_kernels.gated_delta_rule import GDNVarlen, chunk_gated_delta_rule, fla_unusable_reason  # noqa: E402


def inputs(lens, heads=16, dk=128, dv=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q = torch.nn.functional.normalize(rnd(1, T, heads, dk), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(rnd(1, T, heads, dk), dim=-1).bfloat16()
    v = rnd(1, T, heads, dv).bfloat16()
    gate = -torch.nn.functional.softplus(rnd(1, T, heads))  # log-space decay, fp32 like the model's
    beta = torch.sigmoid(rnd(1, T, heads)).bfloat16()
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return [t.requires_grad_() for t in (q, k, v, gate, beta)], cu


def run(tensors, cu_dev, varlen, cot):
    out = chunk_gated_delta_rule(*tensors, cu_dev, "fla", varlen)
    grads = torch.autograd.grad(out, tensors, cot)
    return out, grads


def timed(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)
    reason = fla_unusable_reason()
    if reason:
        print(f"cannot run: {reason}")
        return 2
    results, failed = [], 0
    for lens in ([1000, 1, 3, 3095, 4093], [8192], [37, 64, 65, 127, 7899]):
        tensors, cu = inputs(lens)
        cu_dev = cu.cuda()
        varlen = GDNVarlen.from_host(cu, "cuda")
        cot = torch.randn(tensors[2].shape, device="cuda").bfloat16()
        own = run(tensors, cu_dev, None, cot)
        ours = run(tensors, cu_dev, varlen, cot)
        same = torch.equal(own[0], ours[0]) and all(torch.equal(a, b) for a, b in zip(own[1], ours[1]))
        ms_own = timed(lambda: run(tensors, cu_dev, None, cot), args.iters)
        ms_ours = timed(lambda: run(tensors, cu_dev, varlen, cot), args.iters)
        failed += not same
        row = {"lens": lens, "bit_identical": same, "ms_per_call_fla_builds_table": ms_own,
               "ms_per_call_precomputed_table": ms_ours}
        results.append(row)
        print(f"{'ok' if same else 'FAIL'}  lens={lens}  fwd+bwd per call: fla builds the table {ms_own:.3f} ms, "
              f"precomputed {ms_ours:.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=1))
    return 1 if failed else 0


@pytest.mark.gpu
def test_precomputed_varlen_table_is_bit_identical_to_fla_building_it(run_check):
    """The trainer's precomputed chunk table gives fla's own outputs and gradients bit for bit."""
    run_check(__file__)


if __name__ == "__main__":
    sys.exit(main())
