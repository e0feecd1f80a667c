"""AdamW step of the 2B model's parameters on one GPU: torch's fused AdamW (with the grad_scale the
trainer passes) plus megatron's fp32 -> bf16 parameter copy, against fused_kernels/flat_adamw.py (one
kernel over flat buffers that also writes the bf16 parameters), and the flat kernel's agreement
with torch.

    python scripts/bench_adamw.py [--json OUT]

Shapes: the 2B recipe's parameters (configs/qwen35_vl_2b.yaml), counted from the model's layer
shapes below (2.21B elements). Prints ms and GB/s over the bytes each must move.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import torch  # noqa: E402

from fused_kernels.flat_adamw import chunk_table, flat_adamw  # noqa: E402


def shapes_2b() -> list[tuple[int, ...]]:
    """Parameter shapes of the 2B recipe: 18 GDN + 6 attention decoder layers, 24 vision blocks,
    the tied embedding (an approximation of the small tensors is enough for bandwidth)."""
    gdn = [(12288, 2048), (2048, 2048), (64, 2048), (8192, 4), (2048,), (32,), (32,), (128,)]
    attn = [(8192, 2048), (2048, 4096), (2048,), (256,), (256,)]
    mlp = [(12288, 2048), (2048, 6144), (2048,)]
    vis = [(3072, 1024), (3072,), (1024, 1024), (1024,), (4096, 1024), (4096,), (1024, 4096), (1024,),
           (1024,), (1024,), (1024,), (1024,)]
    out = []
    for i in range(24):
        out += (attn if i % 4 == 3 else gdn) + mlp
    out += vis * 24
    out += [(248320, 2048), (2048,), (2304, 1024), (1024, 3 * 2 * 14 * 14), (4096, 4096), (2048, 4096)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_adamw.py needs a CUDA device")
    from triton.testing import do_bench

    dev = "cuda"
    torch.manual_seed(0)
    shapes = shapes_2b()
    numels = [int(torch.Size(s).numel()) for s in shapes]
    align = 64  # the gradient buffer pads each parameter's start
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += (n + align - 1) // align * align
    total, N = pos, sum(numels)
    print(f"{len(shapes)} tensors, {N / 1e9:.3f}B elements")
    p32 = torch.randn(total, device=dev)
    g32 = torch.randn(total, device=dev) * 1e-3
    m32 = torch.randn(total, device=dev) * 1e-3
    v32 = torch.rand(total, device=dev) * 1e-6
    p16 = torch.empty(total, device=dev, dtype=torch.bfloat16)
    views = lambda t: [t[o:o + n] for o, n in zip(offsets, numels)]  # noqa: E731
    ps, gs, ms, vs, bfs = views(p32), views(g32), views(m32), views(v32), views(p16)
    steps = [torch.tensor(10.0, device=dev) for _ in ps]
    scale = torch.tensor([0.5], device=dev)
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8)
    gb = lambda nbytes, ms_: nbytes / ms_ / 1e6  # noqa: E731
    result = {"elements": N, "tensors": len(shapes), "device": torch.cuda.get_device_name()}

    def torch_step():
        torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False, grad_scale=scale, **hp)
        torch._foreach_copy_(bfs, ps)

    t = do_bench(torch_step, warmup=3, rep=300)
    # torch's fused kernel with grad_scale writes the unscaled gradient back: 32 + 2 (copy) + 4 (copy's read)
    print(f"torch _fused_adamw_(grad_scale) + foreach copy: {t:7.3f} ms  {gb(N * 38, t):6.0f} GB/s")
    result["torch_fused_plus_copy_ms"] = t
    t1 = do_bench(lambda: torch._fused_adamw_(ps, gs, ms, vs, [], steps, amsgrad=False, maximize=False,
                                              grad_scale=scale, **hp), warmup=3, rep=300)
    print(f"  of which _fused_adamw_: {t1:7.3f} ms")
    result["torch_fused_ms"] = t1

    best = None
    result["flat"] = []
    for block, chunk_blocks, warps in [(1024, 8, 4), (2048, 8, 8), (2048, 16, 8), (4096, 4, 8), (4096, 8, 16),
                                       (1024, 32, 4), (2048, 4, 4)]:
        chunk = block * chunk_blocks
        starts, state_starts, lengths = chunk_table(list(zip(offsets, numels)), dev, chunk=chunk)
        fn = lambda: flat_adamw(p32, g32, m32, v32, p16, starts, state_starts, lengths, step=11, grad_scale=scale,  # noqa: E731
                                block=block, chunk=chunk, num_warps=warps, **hp)
        tf = do_bench(fn, warmup=3, rep=300)
        print(f"flat kernel BLOCK={block} CHUNK={chunk} warps={warps}: {tf:7.3f} ms  {gb(N * 30, tf):6.0f} GB/s")
        result["flat"].append({"block": block, "chunk": chunk, "warps": warps, "ms": tf})
        best = tf if best is None else min(best, tf)
    result["flat_best_ms"] = best
    print(f"saving per step: {t - best:.3f} ms")

    # agreement with torch's fused AdamW from one fresh state (the timing loops above left theirs
    # at inf: torch's kernel writes the unscaled gradient back, doubling it every call)
    torch.manual_seed(1)  # refilled in place: the timing closures still hold these buffers
    g32.normal_().mul_(1e-3)
    p32.normal_()
    m32.normal_().mul_(1e-3)
    v32.uniform_().mul_(1e-6)
    ref = [t_.clone() for t_ in (p32, m32, v32)]
    rps, rms, rvs = views(ref[0]), views(ref[1]), views(ref[2])
    rsteps = [torch.tensor(0.0, device=dev) for _ in offsets]
    starts, state_starts, lengths = chunk_table(list(zip(offsets, numels)), dev)
    for k in range(1, 4):
        # torch.optim.AdamW increments the step before its kernel reads it (step 0 would divide by
        # a zero bias correction and makes every parameter non-finite)
        torch._foreach_add_(rsteps, 1)
        torch._fused_adamw_(rps, views(g32.clone()), rms, rvs, [], rsteps, amsgrad=False, maximize=False,
                            grad_scale=scale, **hp)
        flat_adamw(p32, g32, m32, v32, p16, starts, state_starts, lengths, step=k, grad_scale=scale, **hp)
    seg = torch.zeros(total, dtype=torch.bool, device=dev)
    for o, n in zip(offsets, numels):
        seg[o:o + n] = True
    errs = {}
    for name, a, b in [("param", p32, ref[0]), ("exp_avg", m32, ref[1]), ("exp_avg_sq", v32, ref[2])]:
        # non-finite values on either side are counted, not silently compared
        errs[f"{name}_nonfinite_flat"] = int((~torch.isfinite(a)).sum())
        errs[f"{name}_nonfinite_torch"] = int((~torch.isfinite(b)).sum())
        d = (a - b).abs()
        d = torch.where(torch.isfinite(d), d, 0.0)
        errs[name] = (d.max() / torch.where(torch.isfinite(b), b.abs(), 0.0).max()).item()
        del d
    errs["bf16_copy_vs_torch_rounding"] = (p16.float() - p32.bfloat16().float())[seg].abs().max().item()
    print("flat vs torch fused after 3 steps, max rel diff:", errs)
    result["agreement"] = errs
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
