"""Parity of the fused kernels against their PyTorch references: forward and every input gradient.

    python tests/gpu/test_fused_kernels_gpu.py             # the full set, on the GPU
    TRITON_INTERPRET=1 python tests/gpu/test_fused_kernels_gpu.py --small --device cpu --json -

The reference runs in fp32 on fp32 copies of the inputs (the ground truth); the fused kernel
runs in the case's dtype. Error = max |fused - ref| / max |ref| per output and per gradient,
against a tolerance of a few roundings of that dtype. Prints a table; exits 1 on any failure.
tests/test_fused_kernels.py runs the --small set under the Triton interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

# parity compiles many shapes; autotuning each would take minutes and changes no result
os.environ.setdefault("FUSED_KERNELS_AUTOTUNE", "0")

from fused_kernels import fused_mrope as fm  # noqa: E402
from fused_kernels import fused_pre_gdr as fp  # noqa: E402
from fused_kernels import fused_swiglu as fs  # noqa: E402
from fused_kernels.rotary import inverse_frequencies  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.6e-2}


def _rel(out, ref) -> float:
    if ref.numel() == 0:
        return 0.0 if out.shape == ref.shape else float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()


def _grads(outs, seed):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=g).to(o.device) for o in outs]


def _compare(name, fused_fn, ref_fn, inputs, dtype, seed=0):
    """Run both on the same inputs (fused in dtype, reference in fp32); per-tensor relative errors."""
    # keep=True: the input stays fp32 in the fused run too (A_log, dt_bias are fp32 parameters)
    f_in = [t.detach().to(torch.float32 if keep else dtype).requires_grad_() for t, keep in inputs]
    r_in = [t.detach().float().requires_grad_() for t in f_in]
    outs = fused_fn(*f_in)
    refs = ref_fn(*r_in)
    outs, refs = (outs,) if torch.is_tensor(outs) else outs, (refs,) if torch.is_tensor(refs) else refs
    cots = _grads(refs, seed)
    fg = torch.autograd.grad(outs, f_in, [c.to(o.dtype) for c, o in zip(cots, outs)])
    rg = torch.autograd.grad(refs, r_in, cots)
    errs = {f"out{i}": _rel(o, r) for i, (o, r) in enumerate(zip(outs, refs))}
    errs.update({f"grad{i}": _rel(a, b) for i, (a, b) in enumerate(zip(fg, rg))})
    dtypes_ok = all(o.dtype == r.dtype or r.dtype == torch.float32 for o, r in zip(outs, refs))
    shapes_ok = all(o.shape == r.shape for o, r in zip(outs, refs)) and dtypes_ok
    return errs, shapes_ok


# ----------------------------------------------------------------------------- mRoPE cases


def mrope_case(device, dtype_name, layout, B, S, H, D, rot, section, interleaved=True, lens=None, cp=1, seed=0):
    """One mRoPE parity case. lens: packed sample lengths (THD); cp > 1: zigzag mode, all ranks."""
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[dtype_name]
    inv = inverse_frequencies(rot, 1e7).to(device)
    results = []
    if cp > 1:  # full packed sequence positions, each rank holds its zigzag share of tokens
        total = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        pos = torch.randint(0, 40000, (3, 1, total), generator=g).to(device)
        for rank in range(cp):
            x = torch.randn(total // cp, H, D, generator=g).to(device)
            errs, ok = _compare(
                "mrope",
                lambda x: fm.fused_mrope(x, pos, inv, section, interleaved, "thd", cu, cp, rank),
                lambda x: fm.mrope_reference(x, pos, inv, section, interleaved, "thd", cu, cp, rank),
                [(x, False)], dtype, seed)
            results.append(dict(kernel="mrope", case=f"{layout} {dtype_name} lens={lens} H={H} D={D} rot={rot} "
                                f"cp={cp} rank={rank}", dtype=dtype_name, errs=errs, shapes_ok=ok))
        return results
    pos = torch.randint(0, 40000, (3, B, S), generator=g)
    if lens is not None:  # packed: positions restart per sample like the data pipeline's
        pos = torch.cat([torch.arange(n).expand(3, 1, n) + torch.randint(0, 3, (3, 1, 1), generator=g)
                         for n in lens], dim=-1)
    pos = pos.to(device)
    shape = {"bshd": (B, S, H, D), "sbhd": (S, B, H, D), "thd": (S, H, D)}[layout]
    x = torch.randn(*shape, generator=g).to(device)
    p = pos[:, 0] if layout == "thd" else pos
    errs, ok = _compare(
        "mrope",
        lambda x: fm.fused_mrope(x, p, inv, section, interleaved, layout),
        lambda x: fm.mrope_reference(x, p, inv, section, interleaved, layout),
        [(x, False)], dtype, seed)
    return [dict(kernel="mrope", case=f"{layout} {dtype_name} B={B} S={S} H={H} D={D} rot={rot} "
                 f"{'interleaved' if interleaved else 'blocked'}{' lens=' + str(lens) if lens else ''}",
                 dtype=dtype_name, errs=errs, shapes_ok=ok)]


def mrope_pair_case(device, dtype_name, layout, S, Hq, Hk, D, rot, section, seed=0):
    """The attention layer's q and k rotated as one pair (``fused_mrope_pair``): both outputs and
    both input gradients."""
    g = torch.Generator().manual_seed(seed)
    inv = inverse_frequencies(rot, 1e7).to(device)
    pos = torch.randint(0, 40000, (3, 1, S), generator=g).to(device)
    p = pos[:, 0] if layout == "thd" else pos
    shape = {"bshd": (1, S), "sbhd": (S, 1), "thd": (S,)}[layout]
    q = torch.randn(*shape, Hq, D, generator=g).to(device)
    k = torch.randn(*shape, Hk, D, generator=g).to(device)
    errs, ok = _compare("mrope_pair", lambda a, b: fm.fused_mrope_pair(a, b, p, inv, section, True, layout),
                        lambda a, b: [fm.mrope_reference(t, p, inv, section, True, layout) for t in (a, b)],
                        [(q, False), (k, False)], DTYPES[dtype_name], seed)
    return [dict(kernel="mrope_pair", case=f"{layout} {dtype_name} S={S} Hq={Hq} Hk={Hk} D={D} rot={rot}",
                 dtype=dtype_name, errs=dict(zip(["q", "k", "d_q", "d_k"], errs.values())), shapes_ok=ok)]


def rotary_qkv_case(device, dtype_name, T, H, D, seed=0, without_k=False):
    """The vision blocks' q/k/v split with q and k rotated (blocked 2-D rotary, section (0, n, n)
    over the whole head): outputs q, k, v and the gradient of the [T, 3, H, D] projection.
    ``without_k``: k is left out of the loss (its gradient slot must come back zero)."""
    g = torch.Generator().manual_seed(seed)
    n = D // 4
    base = inverse_frequencies(D // 2, 10000.0)  # the vision encoder's: n frequencies over half a head
    inv = torch.cat([base, base]).to(device)  # as the vision encoder hands it to the kernel
    pos = torch.randint(0, 48, (3, T), generator=g).to(device)
    qkv = torch.randn(T, 3, H, D, generator=g).to(device)
    section = (0, n, n)
    keep = (0, 2) if without_k else (0, 1, 2)
    errs, ok = _compare("rotary_qkv", lambda x: [fm.rotary_qkv(x, pos, inv, section)[i] for i in keep],
                        lambda x: [fm.rotary_qkv_reference(x, pos, inv, section)[i] for i in keep], [(qkv, False)],
                        DTYPES[dtype_name], seed)
    names = [["q", "k", "v"][i] for i in keep] + ["d_qkv"]
    return [dict(kernel="rotary_qkv", case=f"{dtype_name} T={T} H={H} D={D}{' without k' if without_k else ''}",
                 dtype=dtype_name, errs=dict(zip(names, errs.values())), shapes_ok=ok)]


# ----------------------------------------------------------------------------- pre-GDR cases


def pre_gdr_case(device, dtype_name, B, S, nk, nv, K, V, lens=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[dtype_name]
    C = 2 * nk * K + nv * V
    # the in_proj output as megatron hands it: [S, B, D], read through a transposed view
    proj = torch.randn(S, B, C + 2 * nv + 3, generator=g).to(device)
    x = proj.transpose(0, 1)
    qkv, b, a = x[..., :C], x[..., C:C + nv], x[..., C + nv:C + 2 * nv]
    w = (torch.randn(C, 4, generator=g) * 0.5).to(device)
    a_log = (torch.rand(nv, generator=g) * 2 - 1).to(device)
    dt = torch.randn(nv, generator=g).to(device)
    cu = None
    if lens is not None:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    # A_log and dt_bias stay fp32 (as the model keeps them); the rest in the case's dtype
    errs, ok = _compare(
        "pre_gdr",
        lambda *t: fp.fused_pre_gdr(*t, cu, nk, K, V),
        lambda *t: fp.pre_gdr_reference(*t, cu, nk, K, V),
        [(qkv, False), (b, False), (a, False), (w, False), (a_log, True), (dt, True)], dtype, seed)
    names = ["q", "k", "v", "g", "beta", "d_qkv", "d_b", "d_a", "d_conv_w", "d_A_log", "d_dt_bias"]
    errs = dict(zip(names, errs.values()))
    return [dict(kernel="pre_gdr", case=f"{'thd' if lens else 'bshd'} {dtype_name} B={B} S={S} nk={nk} nv={nv} "
                 f"K={K} V={V}{' lens=' + str(lens) if lens else ''}", dtype=dtype_name, errs=errs, shapes_ok=ok)]


# ----------------------------------------------------------------------------- SwiGLU cases


def swiglu_case(device, dtype_name, shape, seed=0):
    """fc1's output [..., 2F] as the MLP hands it: [S, B, 2F] (or [tokens, 2F] for experts)."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(*shape, generator=g) * 3).to(device)  # wide enough to reach silu's tails
    errs, ok = _compare("swiglu", fs.swiglu, fs.swiglu_reference, [(y, False)], DTYPES[dtype_name], seed)
    return [dict(kernel="swiglu", case=f"{dtype_name} {list(shape)}", dtype=dtype_name,
                 errs=dict(zip(["out", "d_fc1"], errs.values())), shapes_ok=ok)]


# ----------------------------------------------------------------------------- case sets


def small_cases(device):
    """Small shapes for the Triton interpreter on CPU (every layout, dtype, CP rank)."""
    out = []
    for dt in DTYPES:
        for layout in ("bshd", "sbhd", "thd"):
            out += mrope_case(device, dt, layout, 2 if layout != "thd" else 1, 7, 3, 256, 64, [11, 11, 10])
    out += mrope_case(device, "fp32", "sbhd", 3, 5, 2, 32, 8, [2, 1, 1])  # the proxy's head
    out += mrope_case(device, "fp32", "bshd", 1, 9, 2, 64, 64, [16, 8, 8], interleaved=False)  # no pass-through
    out += mrope_case(device, "bf16", "thd", 1, 12, 2, 256, 64, [11, 11, 10], lens=[5, 1, 6])
    out += mrope_case(device, "bf16", "thd", 1, 9, 2, 72, 72, [0, 18, 18], interleaved=False)  # a vision head
    out += mrope_case(device, "fp32", "thd", 1, 0, 2, 256, 64, [11, 11, 10], lens=[8, 4, 12], cp=2)
    out += mrope_case(device, "bf16", "thd", 1, 0, 3, 256, 64, [11, 11, 10], lens=[16, 8], cp=4)
    out += mrope_pair_case(device, "fp32", "sbhd", 7, 4, 2, 32, 8, [2, 1, 1])  # the proxy's heads
    out += mrope_pair_case(device, "bf16", "thd", 9, 4, 2, 256, 64, [11, 11, 10])
    out += rotary_qkv_case(device, "fp32", 9, 2, 16)
    out += rotary_qkv_case(device, "bf16", 7, 3, 72)  # the 9B+ vision head size
    out += rotary_qkv_case(device, "fp32", 5, 2, 16, without_k=True)
    out += pre_gdr_case(device, "fp32", 2, 11, 2, 4, 16, 8)
    out += pre_gdr_case(device, "fp32", 1, 19, 2, 2, 8, 8, lens=[5, 1, 2, 11])
    out += pre_gdr_case(device, "bf16", 1, 13, 1, 2, 16, 16, lens=[6, 7])
    # empty segments (first, middle, and a tail of them as CUDA graphs pad cu_seqlens), and more
    # than 64 offsets (a longer binary search for each token's sample)
    out += pre_gdr_case(device, "fp32", 1, 19, 1, 1, 8, 8, lens=[0, 5, 1, 0, 13, 0, 0])
    out += pre_gdr_case(device, "fp32", 1, 21, 1, 1, 8, 8, lens=[2] * 9 + [3] + [0] * 60)
    out += pre_gdr_case(device, "fp16", 1, 9, 1, 1, 128, 128)  # the real head size
    for dt in DTYPES:
        out += swiglu_case(device, dt, (7, 2, 2 * 48))
    out += swiglu_case(device, "bf16", (5, 1, 2 * 100))  # a half that is not a multiple of the block
    out += swiglu_case(device, "fp32", (0, 1, 2 * 8))  # no tokens (an expert without any)
    return out


def full_cases(device):
    """Real Qwen3.5 head sizes (2B / 9B / 397B-A17B at TP 1: attention 8/2, 16/4, 32/2 heads; GDN
    value heads 16, 32, 64 over 16 key heads), every layout and dtype, CP 2 and 4 at every rank."""
    out = []
    for layout in ("bshd", "sbhd"):
        for H in (8, 2, 32):
            out += mrope_case(device, "bf16", layout, 2, 1031, H, 256, 64, [11, 11, 10])
    for dt in DTYPES:
        out += mrope_case(device, dt, "sbhd", 1, 2053, 16, 256, 64, [11, 11, 10])
        out += mrope_case(device, dt, "thd", 1, 4099, 4, 256, 64, [11, 11, 10], lens=[1000, 3, 3000, 96])
    for dt in ("bf16", "fp32"):
        for cp in (2, 4):
            out += mrope_case(device, dt, "thd", 1, 0, 8, 256, 64, [11, 11, 10], lens=[1024, 64, 2048 + 8 * cp],
                              cp=cp)
    out += mrope_case(device, "bf16", "sbhd", 1, 333, 4, 32, 8, [2, 1, 1])  # the proxy's head
    out += mrope_case(device, "fp32", "bshd", 1, 333, 4, 128, 128, [24, 20, 20], interleaved=False)
    out += mrope_case(device, "bf16", "thd", 1, 4099, 16, 72, 72, [0, 18, 18], interleaved=False)  # vision 9B+
    for dt in DTYPES:
        out += mrope_pair_case(device, dt, "sbhd", 8192, 8, 2, 256, 64, [11, 11, 10])  # 2B attention
        out += rotary_qkv_case(device, dt, 3136, 16, 64)  # 2B vision heads, one 896x896 image's patches
    out += rotary_qkv_case(device, "bf16", 4099, 16, 72)  # 9B+ vision heads
    for nk, nv in ((16, 16), (16, 32), (16, 64)):
        out += pre_gdr_case(device, "bf16", 1, 4099, nk, nv, 128, 128, lens=[1000, 1, 3, 3095])
    out += pre_gdr_case(device, "bf16", 2, 1023, 16, 32, 128, 128)
    for dt in ("fp16", "fp32"):
        out += pre_gdr_case(device, dt, 1, 4099, 16, 32, 128, 128, lens=[1000, 1, 3, 3095])
    out += pre_gdr_case(device, "fp32", 2, 1023, 16, 16, 128, 128)
    out += pre_gdr_case(device, "bf16", 1, 517, 2, 4, 32, 32, lens=[17, 500])  # the proxy's head
    # the CUDA graphs' padded offsets: 5 samples, then empty segments up to 66 offsets
    out += pre_gdr_case(device, "bf16", 1, 8192, 16, 16, 128, 128, lens=[1000, 37, 3000, 2100, 2055] + [0] * 60)
    for dt in DTYPES:  # the 2B MLP (ffn 6144) at 8,192 tokens; a 9B-like width; experts' rows
        out += swiglu_case(device, dt, (8192, 1, 2 * 6144))
    out += swiglu_case(device, "bf16", (4099, 2, 2 * 12288))
    out += swiglu_case(device, "bf16", (1531, 2 * 512))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="the small set (CPU interpreter)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", choices=["mrope", "mrope_pair", "rotary_qkv", "pre_gdr", "swiglu"],
                    help="one kernel's cases")
    ap.add_argument("--quick", action="store_true",
                    help="pre-GDR: three cases (head repeat 1/2/4, packed and padded, bf16 and fp32)")
    ap.add_argument("--json", help="write the results as JSON here ('-' for stdout only)")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.quick:
        results = (pre_gdr_case(args.device, "bf16", 1, 4099, 16, 16, 128, 128, lens=[1000, 1, 3, 3095])
                   + pre_gdr_case(args.device, "bf16", 1, 4099, 16, 64, 128, 128, lens=[1000, 1, 3, 3095])
                   + pre_gdr_case(args.device, "fp32", 2, 1023, 16, 32, 128, 128))
    else:
        results = small_cases(args.device) if args.small else full_cases(args.device)
    if args.only:
        results = [r for r in results if r["kernel"] == args.only]
    failed = 0
    for r in results:
        tol = TOL[r["dtype"]]
        r["tol"] = tol
        r["ok"] = bool(r["shapes_ok"] and all(e <= tol for e in r["errs"].values()))
        failed += not r["ok"]
    if args.json == "-":
        print(json.dumps(results))
        return 1 if failed else 0
    print(f"{'ok':4} {'max rel err':>11} {'worst':>10}  case")
    for r in results:
        worst = max(r["errs"], key=r["errs"].get)
        print(f"{'ok' if r['ok'] else 'FAIL':4} {r['errs'][worst]:11.2e} {worst:>10}  {r['kernel']}: {r['case']}")
    print(f"{len(results) - failed}/{len(results)} cases pass ({time.time() - t0:.1f}s)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


@pytest.mark.gpu
def test_fused_kernels_match_their_references(run_check):
    """Every fused kernel case (forward and every input gradient) within its dtype's tolerance."""
    run_check(__file__)


if __name__ == "__main__":
    sys.exit(main())
