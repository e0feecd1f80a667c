"""Launch-config sweep of the three pre-GDR kernels on one layer's shape (GPU).

    python scripts/sweep_pre_gdr.py [--seq 8192] [--models 2B,9B] [--pad-to 66] [--json OUT]

Each kernel (``_pre_gdr_fwd``, ``_pre_gdr_bwd`` phase 1, ``_conv_fold``) is launched directly
with explicit block sizes and warp counts, bypassing the autotuner, and timed with
``triton.testing.do_bench``. Every config is run packed (cu_seqlens padded with empty tail
segments as the CUDA graphs pad them); one config per kernel (session 7's default) also runs
unpacked (no sample search), so that the cost of finding each token's sample is visible. GB/s counts the bytes each kernel
must move (inputs once, outputs once); the device's copy bandwidth is printed first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import fused_pre_gdr as fp  # noqa: E402
from kernels.triton_support import cu_steps  # noqa: E402

MODELS = {"2B": (16, 16), "9B": (16, 32)}  # GDN (key heads, value heads) per TP rank; K = V = 128


def _inputs(seq: int, nk: int, nv: int, pad_to: int, dtype=torch.bfloat16):
    K = V = 128
    C = 2 * nk * K + nv * V
    width = C + nv * V + 2 * nv  # in_proj's output: qkv, z, b, a (the kernel reads strided views)
    proj = torch.randn(1, seq, width, device="cuda", dtype=dtype)
    qkv, b, a = proj[..., :C], proj[..., width - 2 * nv:width - nv], proj[..., width - nv:]
    cu = torch.linspace(0, seq, 5, device="cuda").round().int()
    cu = torch.cat([cu, cu.new_full((max(0, pad_to - cu.numel()),), seq)])
    t = dict(qkv=qkv, b=b, a=a, w=(torch.randn(C, 4, device="cuda") * 0.3).to(dtype),
             alog=torch.rand(nv, device="cuda").to(dtype), dt=torch.randn(nv, device="cuda").to(dtype),
             cu=cu, q=torch.empty(1, seq, nv, K, device="cuda", dtype=dtype),
             v=torch.empty(1, seq, nv, V, device="cuda", dtype=dtype),
             g=torch.empty(1, seq, nv, device="cuda"), beta=torch.empty(1, seq, nv, device="cuda", dtype=dtype),
             du=torch.randn(1, seq, C, device="cuda", dtype=dtype), dx=torch.empty(1, seq, C, device="cuda", dtype=dtype))
    t["k"] = torch.empty_like(t["q"])
    t["dq"], t["dk"], t["dv"] = torch.randn_like(t["q"]), torch.randn_like(t["q"]), torch.randn_like(t["v"])
    t["dg"], t["dbeta"] = torch.randn_like(t["g"]), torch.randn_like(t["beta"])
    t["db"], t["da"] = torch.empty_like(t["beta"]), torch.empty_like(t["beta"])
    return t, C, K, V


def _fwd(t, S, C, nk, nv, K, V, varlen, bt, nw):
    qkv, b, a = t["qkv"], t["b"], t["a"]
    n_cu = t["cu"].numel()
    grid = (triton.cdiv(S, bt), 2 * nk + nv, 1)
    return lambda: fp._pre_gdr_fwd.fn[grid](
        qkv, t["w"], b, a, t["alog"], t["dt"], t["cu"], t["q"], t["k"], t["v"], t["g"], t["beta"],
        S, n_cu, qkv.stride(0), qkv.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        C=C, NK=nk, NV=nv, K=K, V=V, VARLEN=varlen, BLOCK_C=128, CU_STEPS=cu_steps(n_cu), BLOCK_T=bt, num_warps=nw)


def _bwd(t, S, C, nk, nv, K, V, varlen, bt, nw, tpp):
    qkv, b, a = t["qkv"], t["b"], t["a"]
    n_cu = t["cu"].numel()
    n_pt = triton.cdiv(S, tpp)
    dw = torch.empty(n_pt, C, 4, device="cuda")
    al, dtp = torch.empty(n_pt, nv, device="cuda"), torch.empty(n_pt, nv, device="cuda")
    return lambda: fp._pre_gdr_bwd.fn[(n_pt, 2 * nk + nv, 1)](
        qkv, t["w"], b, a, t["alog"], t["dt"], t["cu"], t["dq"], t["dk"], t["dv"], t["dg"], t["dbeta"],
        t["du"], t["db"], t["da"], dw, al, dtp,
        S, n_cu, qkv.stride(0), qkv.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        C=C, NK=nk, NV=nv, K=K, V=V, VARLEN=varlen, BLOCK_C=128, CU_STEPS=cu_steps(n_cu), TPP=tpp,
        BLOCK_T=bt, num_warps=nw)


def _fold(t, S, C, varlen, bt, bc, nw):
    n_cu = t["cu"].numel()
    return lambda: fp._conv_fold[(triton.cdiv(S, bt), triton.cdiv(C, bc), 1)](
        t["du"], t["w"], t["cu"], t["dx"], S, n_cu, C=C, VARLEN=varlen, CU_STEPS=cu_steps(n_cu),
        BLOCK_T=bt, BLOCK_C=bc, num_warps=nw)


def _time(fn) -> float | None:
    try:
        return do_bench(fn, warmup=10, rep=60)
    except Exception as e:  # noqa: BLE001  (a config that does not compile, e.g. out of registers)
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        return None


def _copy_gbps() -> float:
    x = torch.empty(2**28, device="cuda", dtype=torch.float32)  # 1 GiB read + 1 GiB written
    return 2 * x.numel() * 4 / do_bench(x.clone, rep=100) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--models", default="2B,9B")
    ap.add_argument("--pad-to", type=int, default=66, help="cu_seqlens entries (the graphs pad to 66)")
    ap.add_argument("--quick", action="store_true", help="the configs near the chosen ones only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_pre_gdr.py needs a CUDA device", file=sys.stderr)
        return 2
    copy_gbps = _copy_gbps()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    S = args.seq
    for name in args.models.split(","):
        nk, nv = MODELS[name]
        t, C, K, V = _inputs(S, nk, nv, args.pad_to)
        e = 2
        qkv_out = (2 * nv * K + nv * V) * e  # q, k, v per token (key heads repeated)
        bytes_ = {"fwd": S * (C * e + 2 * nv * e + qkv_out + nv * (4 + e)),
                  "bwd": S * (C * e + 2 * nv * e + qkv_out + nv * (4 + e) + C * e + 2 * nv * e),
                  "fold": S * 2 * C * e}
        grid = {"fwd": [(bt, nw) for bt in (8, 16, 32, 64) for nw in (1, 2, 4, 8)],
                "bwd": [(bt, nw, tpp) for tpp in (64, 256, 512) for bt in (8, 16, 32) for nw in (2, 4, 8)],
                "fold": [(bt, bc, nw) for bt in (16, 32, 64) for bc in (64, 128, 256) for nw in (2, 4, 8)]}
        if args.quick:
            grid = {"fwd": [(bt, nw) for bt in (8, 16, 32, 64) for nw in (1, 2, 4)],
                    "bwd": [(bt, nw, 256) for bt in (8, 16) for nw in (2, 4)], "fold": [(16, 128, 2), (32, 128, 4)]}
        cases = [("fwd", dict(bt=bt, nw=nw), _fwd(t, S, C, nk, nv, K, V, True, bt, nw)) for bt, nw in grid["fwd"]]
        cases.append(("fwd", dict(bt=16, nw=8, varlen=False), _fwd(t, S, C, nk, nv, K, V, False, 16, 8)))
        cases += [("bwd", dict(bt=bt, nw=nw, tpp=tpp), _bwd(t, S, C, nk, nv, K, V, True, bt, nw, tpp))
                  for bt, nw, tpp in grid["bwd"]]
        cases.append(("bwd", dict(bt=16, nw=8, tpp=256, varlen=False), _bwd(t, S, C, nk, nv, K, V, False, 16, 8, 256)))
        cases += [("fold", dict(bt=bt, bc=bc, nw=nw), _fold(t, S, C, True, bt, bc, nw)) for bt, bc, nw in grid["fold"]]
        cases.append(("fold", dict(bt=32, bc=128, nw=4, varlen=False), _fold(t, S, C, False, 32, 128, 4)))
        for kernel, cfg, fn in cases:
            ms = _time(fn)
            row = dict(model=name, seq=S, kernel=kernel, offsets=t["cu"].numel(), ms=ms,
                       gbps=bytes_[kernel] / ms / 1e6 if ms else None, **cfg)
            rows.append(row)
            if ms:
                print(f"{name} {kernel:4} {cfg}  {ms:.4f} ms  {row['gbps']:.0f} GB/s "
                      f"({100 * row['gbps'] / copy_gbps:.0f}% of copy)", flush=True)
        for kernel in ("fwd", "bwd", "fold"):
            best = min((r for r in rows if r["model"] == name and r["kernel"] == kernel and r["ms"]
                        and r.get("varlen", True)), key=lambda r: r["ms"])
            print(f"BEST {name} {kernel}: {best}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(copy_gbps=copy_gbps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
