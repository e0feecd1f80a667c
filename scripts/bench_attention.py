"""Time the attention kernels a packed row can use, on the decoder's and the vision encoder's shapes (GPU).

    python scripts/bench_attention.py [--json OUT] [--seq 8192] [--samples 1,4]

Why: the full-attention backward at head_dim 256 (flash attention 2, through
``torch.nn.attention.varlen``) is a visible share of the 2B step (docs/kernels.md). This measures
which kernel the packed layout should use. Backends, each on the
same packed inputs ``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` with ``cu_seqlens``:

- ``flash_varlen``: what ``models/common/attention.py`` runs today (GQA inside the kernel);
- ``flash_varlen_mha``: the same with k/v repeated to Hq heads (the cost of the repeat included);
- ``cudnn_ragged``: ``aten._cudnn_attention_forward/backward`` on the packed layout with ragged
  offsets (k/v repeated to the query heads). Not used by the model: wrong dq in torch 2.11;
- ``cudnn_ragged_padded``: the same with 64 empty segments appended to ``cu_seqlens``, as the
  CUDA graphs pad it;
- ``auto_one_segment``: ``attention(..., one_segment=True)``, the model's path for a one-sample row
  (cuDNN, dense); only when the row is one sample;
- ``cudnn_dense`` / ``flash_dense``: SDPA on ``[1, H, T, D]``, only when the row is one sample.

Per backend: forward and forward+backward milliseconds (CUDA events, triton's do_bench), TFLOP/s
over the causal-masked FLOPs actually needed, the largest relative difference of the output and
of dq, dk, dv against ``flash_varlen``, and (``err_fp32_*``) against an fp32 SDPA reference on the
same inputs, which says which bf16 kernel is closer to the exact result. A backend that cannot
run prints why.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


# q heads, kv heads, head dim, causal (per TP rank 1; the vision rows are half the decoder's length)
SHAPES = {"decoder_2b": (8, 2, 256, True), "decoder_9b": (16, 4, 256, True), "vision": (16, 16, 64, False)}


def _flops(cu: list[int], hq: int, d: int, causal: bool) -> tuple[float, float]:
    """Forward and backward FLOPs of attention over the segments (QK^T and PV; backward 2.5x)."""
    pairs = sum((b - a) * (b - a + 1) / 2 if causal else (b - a) ** 2 for a, b in zip(cu, cu[1:]))
    fwd = 4 * pairs * hq * d
    return fwd, 2.5 * fwd


def _repeat(k, v, hq):
    rep = hq // k.shape[1]
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))


class _CudnnRagged(torch.autograd.Function):
    """aten's cuDNN attention over ragged offsets (the packed layout), for the record: in torch
    2.11 its dq was wrong by orders of magnitude and a training step faulted with it."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, causal):
        out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, causal, False)
        ctx.save_for_backward(q, k, v, out[0], out[1], out[6], out[7], cu)
        ctx.max_len, ctx.causal = max_len, causal
        return out[0]

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse, seed, offset, cu = ctx.saved_tensors
        n = ctx.max_len
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            g.contiguous(), q, k, v, o, lse, seed, offset, None, cu, cu, n, n, 0.0, ctx.causal)
        return dq, dk, dv, None, None, None


def backends(causal: bool, one_sample: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.common.attention import _varlen, attention

    def ragged(q, k, v, cu, n):  # cuDNN's packed path, called directly (not used by the model)
        k, v = _repeat(k, v, q.shape[1])
        return _CudnnRagged.apply(q, k, v, cu.to(torch.int32), n, causal)

    def flash_varlen(q, k, v, cu, n):
        return _varlen(q, k, v, cu, n, causal, None)

    def flash_varlen_mha(q, k, v, cu, n):
        k, v = _repeat(k, v, q.shape[1])
        return _varlen(q, k, v, cu, n, causal, None)

    def cudnn_ragged(q, k, v, cu, n):
        return ragged(q, k, v, cu, n)

    def cudnn_ragged_padded(q, k, v, cu, n):  # + 64 empty segments, as under CUDA graphs
        return ragged(q, k, v, torch.cat([cu, cu.new_full((64,), q.shape[0])]), n)

    def auto_one_segment(q, k, v, cu, n):  # what the model runs for a one-sample row
        return attention(q, k, v, causal=causal, cu_seqlens=cu, max_seqlen=n, one_segment=True)

    def dense(kind):
        def run(q, k, v, cu, n):
            k, v = _repeat(k, v, q.shape[1])
            with sdpa_kernel([kind]):
                out = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                                     is_causal=causal)
            return out.squeeze(0).transpose(0, 1)
        return run

    out = {"flash_varlen": flash_varlen, "flash_varlen_mha": flash_varlen_mha, "cudnn_ragged": cudnn_ragged,
           "cudnn_ragged_padded": cudnn_ragged_padded}
    if one_sample:
        out.update(cudnn_dense=dense(SDPBackend.CUDNN_ATTENTION), flash_dense=dense(SDPBackend.FLASH_ATTENTION),
                   auto_one_segment=auto_one_segment)
    return out


def _fp32_reference(q, k, v, g, cu, max_len, causal):
    """Output and input gradients in fp32 (SDPA with a block-diagonal mask), freed after use."""
    from models.common.attention import attention

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    out = attention(qf, kf, vf, causal=causal, cu_seqlens=cu, max_seqlen=max_len, backend="sdpa")
    grads = torch.autograd.grad(out, (qf, kf, vf), g.float())
    return (out.detach(), *grads)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def run_shape(name, seq, samples, reps_ms):
    from triton.testing import do_bench

    hq, hkv, d, causal = SHAPES[name]
    cu_list = [round(i * seq / samples) for i in range(samples + 1)]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq, hq, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    k = torch.randn(seq, hkv, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    v = torch.randn(seq, hkv, d, device="cuda", generator=gen).bfloat16().requires_grad_()
    g = torch.randn(seq, hq, d, device="cuda", generator=gen).bfloat16()
    max_len = max(b - a for a, b in zip(cu_list, cu_list[1:]))
    fwd_flops, bwd_flops = _flops(cu_list, hq, d, causal)
    ref = None
    exact = _fp32_reference(q, k, v, g, cu, max_len, causal)
    rows = []
    for backend, fn in backends(causal, samples == 1).items():
        row = dict(shape=name, seq=seq, samples=samples, hq=hq, hkv=hkv, head_dim=d, causal=causal, backend=backend)
        try:
            out = fn(q, k, v, cu, max_len)
            grads = torch.autograd.grad(out, (q, k, v), g)
            if ref is None:
                ref = (out, *grads)
            row.update({f"rel_diff_{n}": round(_rel(a, b), 5) for n, a, b in zip(("out", "dq", "dk", "dv"),
                                                                                 (out, *grads), ref)})
            row.update({f"err_fp32_{n}": round(_rel(a, b), 5) for n, a, b in zip(("out", "dq", "dk", "dv"),
                                                                                 (out, *grads), exact)})

            def fb():
                torch.autograd.grad(fn(q, k, v, cu, max_len), (q, k, v), g)

            with torch.no_grad():
                fwd_ms = do_bench(lambda: fn(q, k, v, cu, max_len), warmup=5, rep=reps_ms)
            fb_ms = do_bench(fb, warmup=5, rep=reps_ms)
            row.update(fwd_ms=round(fwd_ms, 3), fwd_bwd_ms=round(fb_ms, 3), bwd_ms=round(fb_ms - fwd_ms, 3),
                       fwd_tflops=round(fwd_flops / fwd_ms / 1e9, 1),
                       bwd_tflops=round(bwd_flops / max(fb_ms - fwd_ms, 1e-6) / 1e9, 1))
        except Exception as e:  # noqa: BLE001 - report the backend as unavailable, measure the rest
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        rows.append(row)
        if "error" in row:
            print(f"{name:11} T={seq} samples={samples} {backend:17} cannot run: {row['error']}", flush=True)
        else:
            print(f"{name:11} T={seq} samples={samples} {backend:17} fwd {row['fwd_ms']:7.3f} ms "
                  f"({row['fwd_tflops']:5.0f} TF/s)  bwd {row['bwd_ms']:7.3f} ms ({row['bwd_tflops']:5.0f} TF/s)  "
                  f"diff out {row['rel_diff_out']:.1e} dq {row['rel_diff_dq']:.1e} dk {row['rel_diff_dk']:.1e} "
                  f"dv {row['rel_diff_dv']:.1e}  vs fp32 out {row['err_fp32_out']:.1e} dq {row['err_fp32_dq']:.1e} "
                  f"dk {row['err_fp32_dk']:.1e} dv {row['err_fp32_dv']:.1e}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--samples", default="1,4", help="segments per packed row, comma separated")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rep-ms", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA device", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    rows = []
    for name in args.shapes.split(","):
        for samples in (int(s) for s in args.samples.split(",")):
            seq = args.seq if SHAPES[name][3] else args.seq // 2
            rows += run_shape(name, seq, samples, args.rep_ms)
            if args.json:
                Path(args.json).write_text(json.dumps(dict(torch=torch.__version__,
                                                           cudnn=torch.backends.cudnn.version(),
                                                           device=torch.cuda.get_device_name(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
