"""Benchmark the fused kernels against the unfused PyTorch paths on real Qwen3.5 layer shapes (GPU).

    python scripts/bench_kernels.py [--json OUT] [--seqs 4096,16384,32768]

For each kernel, shape and dtype: forward and forward+backward GPU time (CUDA-graph replay:
see ``bench``), achieved GB/s over the bytes that must move (inputs read
once, outputs written once, forward and backward), and the speedup over the unfused PyTorch
path timed in the same run. The device copy bandwidth (a 1 GiB copy) is measured first, so
each GB/s figure can be read against it (``frac_of_copy``).

Unfused baselines are what the model runs without the switches: mRoPE = apply_rotary on q and
k with the angles already made (the model makes them once per step, so they are not charged
to the layer); pre-GDR = Qwen35GatedDeltaNet.prepare's PyTorch chain (packed: the varlen conv);
SwiGLU = megatron-core's torch.compile'd fused function, which the model ran before
fused_kernels/fused_swiglu.py (the 2B/9B MLPs, and one 397B shared expert's rows).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch


from fused_kernels import fused_mrope as fm  # noqa: E402
from fused_kernels import fused_pre_gdr as fp  # noqa: E402
from fused_kernels import fused_swiglu as fs  # noqa: E402
from fused_kernels.rotary import apply_rotary, axis_of_frequency, inverse_frequencies, mrope_angles  # noqa: E402

# per TP rank 1: (attention q heads, kv heads), (GDN key heads, value heads); head dims 256 / 128
MODELS = {"2B": ((8, 2), (16, 16)), "9B": ((16, 4), (16, 32)), "397B-A17B": ((32, 2), (16, 64))}
FFN = {"2B": 6144, "9B": 12288, "397B-A17B": 1024}  # the dense MLP; 397B: its shared expert


DEV = "cuda"


TIMER = {"name": "cuda-graph"}


def bench(fn) -> float:
    """GPU milliseconds per call of fn: replayed from a CUDA graph, so the host-side cost of Python,
    autograd and kernel launches (which a training step overlaps with earlier GPU work) is not
    charged to either path. Falls back to event timing (do_bench) if capture fails."""
    if DEV != "cuda":  # smoke runs (TRITON_INTERPRET=1 --device cpu): one timed call
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    if TIMER["name"] == "cuda-graph":
        try:
            return _bench_graph(fn)
        except Exception as e:  # noqa: BLE001
            print(f"CUDA-graph timing failed ({type(e).__name__}: {e}); timing with events", flush=True)
            TIMER["name"] = "events"
            torch.cuda.synchronize()
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def _bench_graph(fn, reps: int = 10, trials: int = 3) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and warm the allocator outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(trials):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del graph
    return sorted(times)[len(times) // 2]


def copy_gbps() -> float:
    src = torch.empty(512 * 2**20 if DEV == "cuda" else 2**20, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    if DEV == "cuda":
        # event timing: captured in a CUDA graph, a D2D copy becomes a copy-engine memcpy node
        # (slower on the H200) instead of the SM copy kernel the kernels compete with
        from triton.testing import do_bench

        ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    else:
        ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _fwd_bwd(fn, inputs, cots):
    def run():  # autograd.grad: no accumulation into .grad to charge to either path
        outs = fn(*inputs)
        outs = (outs,) if torch.is_tensor(outs) else outs
        torch.autograd.grad(outs, inputs, cots)
    return run


def _cots(fn, inputs):
    outs = fn(*inputs)
    outs = (outs,) if torch.is_tensor(outs) else outs
    return [torch.randn_like(o) for o in outs]


def _row(kernel, shape, dtype, fused, unfused, inputs, bytes_fwd, bytes_bwd, copy):
    cots = _cots(fused, inputs)
    f_fwd = bench(lambda: fused(*inputs))
    f_fb = bench(_fwd_bwd(fused, inputs, cots))
    u_fwd = bench(lambda: unfused(*inputs))
    u_fb = bench(_fwd_bwd(unfused, inputs, cots))
    gbps = (bytes_fwd + bytes_bwd) / f_fb / 1e6
    return dict(kernel=kernel, shape=shape, dtype=dtype, fwd_ms=round(f_fwd, 4), fwd_bwd_ms=round(f_fb, 4),
                timer=TIMER["name"],
                gbps=round(gbps, 1), speedup_vs_unfused=round(u_fb / f_fb, 2), fwd_gbps=round(bytes_fwd / f_fwd / 1e6, 1),
                fwd_speedup_vs_unfused=round(u_fwd / f_fwd, 2), unfused_fwd_ms=round(u_fwd, 4),
                unfused_fwd_bwd_ms=round(u_fb, 4), copy_gbps=round(copy, 1), frac_of_copy=round(gbps / copy, 3))


def mrope_rows(seq, copy, dtype=torch.bfloat16):
    inv = inverse_frequencies(64, 1e7).to(DEV)
    axis = axis_of_frequency(32, [11, 11, 10])
    pos = torch.arange(seq, device=DEV).expand(3, 1, seq).contiguous()
    pos[1:, :, seq // 4: seq // 2] //= 7  # an image-like stretch: h/w positions differ from t
    angles = mrope_angles(pos, inv, axis).transpose(0, 1).unsqueeze(2)  # made once per step by the model
    for name, ((hq, hkv), _) in MODELS.items():
        q = torch.randn(seq, 1, hq, 256, device=DEV, dtype=dtype, requires_grad=True)
        k = torch.randn(seq, 1, hkv, 256, device=DEV, dtype=dtype, requires_grad=True)

        def fused(q, k):
            return (fm.fused_mrope(q, pos, inv, [11, 11, 10], True, "sbhd"),
                    fm.fused_mrope(k, pos, inv, [11, 11, 10], True, "sbhd"))

        def unfused(q, k):
            return apply_rotary(q, angles), apply_rotary(k, angles)

        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()  # read + write, q and k
        yield (_row("mrope", f"{name} q[{seq},1,{hq},256] k[{seq},1,{hkv},256] rot 64", str(dtype)[6:],
                         fused, unfused, [q, k], nbytes, nbytes, copy))


def pre_gdr_rows(seq, copy, dtype=torch.bfloat16, n_samples=4, pad_to=None):
    K = V = 128
    cu = torch.linspace(0, seq, n_samples + 1, device=DEV).round().int()
    if pad_to:  # empty segments at the end, as the CUDA graphs pad cu_seqlens (layer_graphs.StaticBatch)
        cu = torch.cat([cu, cu.new_full((pad_to + 2 - cu.numel(),), seq)])
    for name, (_, (nk, nv)) in MODELS.items():
        C = 2 * nk * K + nv * V
        # separate leaves (the model reads strided views of in_proj's output; same bytes): a
        # view's backward would charge both paths a zero-filled in_proj-sized gradient
        qkv = torch.randn(1, seq, C, device=DEV, dtype=dtype, requires_grad=True)
        b, a = (torch.randn(1, seq, nv, device=DEV, dtype=dtype, requires_grad=True) for _ in range(2))
        w = (torch.randn(C, 4, device=DEV) * 0.3).to(dtype).requires_grad_()
        a_log = torch.rand(nv, device=DEV).to(dtype).requires_grad_()
        dt = torch.randn(nv, device=DEV).to(dtype).requires_grad_()

        def fused(*t):
            return fp.fused_pre_gdr(*t, cu, nk, K, V)

        def unfused(*t):
            return fp.pre_gdr_reference(*t, cu, nk, K, V)

        e = qkv.element_size()
        tok_fwd = (C + 2 * nv) * e + (2 * nv * K + nv * V + nv) * e + 4 * nv  # read qkv,b,a; write q,k,v,beta,g
        tok_bwd = (C + 2 * nv) * e + (2 * nv * K + nv * V + nv) * e + 4 * nv + (C + 2 * nv) * e  # + grads
        packed = f"{n_samples} packed" + (f", {cu.numel()} offsets" if pad_to else "")
        yield (_row("pre_gdr", f"{name} T={seq} ({packed}) nk={nk} nv={nv} K=V=128", str(dtype)[6:],
                         fused, unfused, [qkv, b, a, w, a_log, dt], seq * tok_fwd, seq * tok_bwd, copy))


def swiglu_rows(seq, copy, dtype=torch.bfloat16):
    from megatron.core.fusions.fused_bias_swiglu import SwiGLUFunction

    for name in MODELS:
        f = FFN[name]
        y = torch.randn(seq, 1, 2 * f, device=DEV, dtype=dtype, requires_grad=True)

        def megatron_compiled(y):
            return SwiGLUFunction.apply(y, False, False)

        e = y.element_size()
        yield _row("swiglu", f"{name} fc1[{seq},1,{2 * f}]", str(dtype)[6:], fs.swiglu, megatron_compiled, [y],
                   seq * 3 * f * e, seq * 5 * f * e, copy)  # fwd: read 2F, write F; bwd: read 3F, write 2F


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here as a JSON list")
    ap.add_argument("--seqs", default="4096,16384,32768")
    ap.add_argument("--models", default="2B,9B,397B-A17B", help="a subset of 2B,9B,397B-A17B")
    ap.add_argument("--kernels", default="mrope,pre_gdr,swiglu", help="a subset of mrope,pre_gdr,swiglu")
    ap.add_argument("--pad-samples", type=int, default=0,
                    help="pad pre-GDR's cu_seqlens with empty segments up to this many samples, as "
                         "train.cuda_graphs does (train.cuda_graphs.max_samples, 64)")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    global DEV, MODELS
    DEV = args.device
    MODELS = {k: MODELS[k] for k in args.models.split(",")}
    if DEV == "cuda" and not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    copy = copy_gbps()
    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    print(f"device copy bandwidth: {copy:.0f} GB/s ({name})", flush=True)
    rows, t0 = [], time.perf_counter()
    for seq in (int(s) for s in args.seqs.split(",")):
        makers = {"mrope": mrope_rows,
                  "pre_gdr": functools.partial(pre_gdr_rows, pad_to=args.pad_samples or None),
                  "swiglu": swiglu_rows}
        for make in (makers[k] for k in args.kernels.split(",")):
            for r in make(seq, copy):
                rows.append(r)
                print(f"[{time.perf_counter() - t0:5.0f}s] {r['kernel']:8} {r['shape']:52} fwd {r['fwd_ms']:7.3f} ms  fwd+bwd {r['fwd_bwd_ms']:7.3f} ms  "
                      f"{r['gbps']:6.0f} GB/s ({100 * r['frac_of_copy']:.0f}% of copy)  "
                      f"x{r['speedup_vs_unfused']:.2f} vs unfused (fwd x{r['fwd_speedup_vs_unfused']:.2f})", flush=True)
                if args.json:  # after every row: a run cut short still leaves its figures
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
