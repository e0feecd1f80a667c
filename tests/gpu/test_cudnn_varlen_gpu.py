"""cuDNN's packed (THD) attention against fp32 math and against flash varlen, on a GPU: forward
and input gradients, under the CUDA graphs' layout (padding segment, empty segment slots,
``max_seqlen`` = the row), and replayed from a CUDA graph with other segment lengths.

    python tests/gpu/test_cudnn_varlen_gpu.py [--json OUT]

Cases: the 2B vision encoder's attention (16 heads of 64, non-causal; q, k, v slices of one
projection, as in the blocks) over four images in an 18,432-row bucket with 17 segments, and the 2B decoder's (8 query / 2 k/v heads of 256, causal)
over three samples in an 8K row. The reference runs each segment through fp32 SDPA math. Passes
when cuDNN's worst relative error on out, dq, dk, dv is within 1.5x flash varlen's (plus 1e-3),
and a graph captured with one set of segment lengths, replayed with another, equals eager cuDNN
on those lengths. Also prints the first call's plan-build time and the timed forward + backward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from models.common import attention as attn
from scripts.bench_varlen_slots import cu_seqlens

CASES = {  # name: (lengths, rows, segments in cu_seqlens, query heads, k/v heads, head dim, causal)
    "vision": ([7056, 3600, 1936, 4900], 18432, 17, 16, 16, 64, False),
    "decoder": ([4096, 2560, 1536], 8192, 17, 8, 2, 256, True),
}
REPLAY_LENGTHS = {"vision": [1024, 6400, 2916, 3136, 4096], "decoder": [512, 7000, 680]}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def reference(q, k, v, g, cu, causal):
    """Each segment through fp32 SDPA math; returns out, dq, dk, dv."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    bounds = cu.tolist()
    outs = []
    with sdpa_kernel([SDPBackend.MATH]):
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                outs.append(attn._sdpa_batched(q32[None, a:b], k32[None, a:b], v32[None, a:b], causal, None)[0])
    out = torch.cat(outs)
    out.backward(g.float())
    return out.detach(), q32.grad, k32.grad, v32.grad


def run(backend, q, k, v, g, cu, max_seqlen, causal):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn.attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=max_seqlen, backend=backend)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


def graph_replay_matches_eager(q, k, v, g, cu, rows, causal, other_lengths, slots) -> float:
    """Capture cuDNN's forward + backward with ``cu``'s lengths, replay with ``other_lengths``;
    the worst relative difference against eager cuDNN on those."""
    sq, sk, sv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    static_cu = cu.clone()

    def step():
        sq.grad = sk.grad = sv.grad = None
        out = attn.attention(sq, sk, sv, causal=causal, cu_seqlens=static_cu, max_seqlen=rows, backend="cudnn")
        out.backward(g)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    other = cu_seqlens(other_lengths, rows, slots)
    static_cu.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    replayed = (static_out, sq.grad, sk.grad, sv.grad)
    eager = run("cudnn", q, k, v, g, other, rows, causal)
    return max(rel(a, b) for a, b in zip(replayed, eager))


def timed_ms(backend, q, k, v, g, cu, max_seqlen, causal, reps=10) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        attn.attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=max_seqlen, backend=backend).backward(g)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the errors, times and the verdict as JSON here")
    args = ap.parse_args()
    reason = attn.cudnn_packed_unavailable(torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    if reason:
        print(f"FAILED: cuDNN's packed attention cannot run here: {reason}")
        sys.exit(1)
    torch.manual_seed(0)
    results, failed = {"cudnn_version": torch.backends.cudnn.version(), "device": torch.cuda.get_device_name()}, []
    for name, (lengths, rows, slots, hq, hkv, d, causal) in CASES.items():
        cu = cu_seqlens(lengths, rows, slots)
        if hq == hkv:  # as in the vision blocks: views of one [T, 3, H, D] projection, not contiguous
            q, k, v = torch.randn(rows, 3, hq, d, device="cuda", dtype=torch.bfloat16).unbind(1)
        else:
            q, k, v = (torch.randn(rows, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
        g = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
        ref = reference(q, k, v, g, cu, causal)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cudnn = run("cudnn", q, k, v, g, cu, rows, causal)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - t0
        flash = run("varlen", q, k, v, g, cu, rows, causal)
        err = {b: [rel(a, r) for a, r in zip(outs, ref)] for b, outs in (("cudnn", cudnn), ("varlen", flash))}
        worse = [i for i in range(4) if err["cudnn"][i] > 1.5 * err["varlen"][i] + 1e-3]
        replay = graph_replay_matches_eager(q, k, v, g, cu, rows, causal, REPLAY_LENGTHS[name], slots)
        ms = {b: timed_ms(b, q, k, v, g, cu, rows, causal) for b in ("cudnn", "varlen")}
        results[name] = {"rel_err_out_dq_dk_dv": err, "graph_replay_vs_eager": replay, "forward_backward_ms": ms,
                         "first_call_s": first_call_s}
        print(f"{name}: rel. error cudnn {['%.2e' % e for e in err['cudnn']]} varlen "
              f"{['%.2e' % e for e in err['varlen']]}; graph replay vs eager {replay:.2e}; "
              f"fwd+bwd cudnn {ms['cudnn']:.2f} ms, flash {ms['varlen']:.2f} ms; first call {first_call_s:.2f} s")
        if worse:
            failed.append(f"{name}: cuDNN is less exact than flash in {worse}")
        if replay > 1e-2:
            failed.append(f"{name}: the graph replayed with other lengths differs from eager by {replay:.2e}")
    print("PASS" if not failed else "FAILED: " + "; ".join(failed))
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "passed": not failed, "failures": failed}, indent=1))
    sys.exit(1 if failed else 0)


@pytest.mark.gpu
def test_cudnn_packed_attention_matches_fp32_math_and_replays_from_a_graph(run_check):
    """cuDNN's THD attention is as exact as flash varlen, and a graph replays it with new lengths."""
    run_check(__file__)


if __name__ == "__main__":
    main()
