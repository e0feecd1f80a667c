"""Peak memory (and time) of the LM loss path, fused linear cross-entropy vs unfused.

    python scripts/bench_loss_memory.py [--seqs 8192 32768] [--vocab 248320] [--hidden 2048] [--json OUT]
    python scripts/bench_loss_memory.py --device cpu --seqs 256 --vocab 4096 --hidden 64   # smoke run

The loss path is hidden states [N, H] -> per-token loss -> masked sum -> backward into the
hidden states and the output weight [V, H], in bf16 (fp32 on CPU), as the model runs it:
  - fused:   fused_kernels.fused_linear_ce (chunked logits; model.fused_linear_ce=true)
  - unfused: logits = h @ W^T in bf16, then megatron's tensor_parallel.vocab_parallel_cross_entropy
             (model.fused_linear_ce=false: megatron's output layer + its loss)
  - plain:   logits = h @ W^T, F.cross_entropy(logits.float()) (the PyTorch reference)
Peak = torch.cuda.max_memory_allocated() during forward + backward minus what was allocated
before (h, W, labels). It includes the gradients dh and dW, which every path produces. The
issue's target: fused <= 1/4 of unfused. Each path also reports its time and its largest
difference from the plain path (loss, dh, dW), so a broken fused kernel on this GPU shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _paths():
    from megatron.core import tensor_parallel

    from fused_kernels.fused_linear_ce import fused_linear_cross_entropy

    def fused(h, w, y):
        return fused_linear_cross_entropy(h, w, y)

    def fused_torch_elementwise(h, w, y):  # the same chunked loss without fused_kernels/ce_triton.py
        from fused_kernels import fused_linear_ce as flce

        saved, flce._use_triton = flce._use_triton, (lambda x: False)
        try:
            return fused_linear_cross_entropy(h, w, y)
        finally:
            flce._use_triton = saved

    def unfused(h, w, y):
        logits = (h @ w.t())[:, None]  # [S, B=1, V] as megatron's output layer returns
        return tensor_parallel.vocab_parallel_cross_entropy(logits, y[:, None])[:, 0]

    def plain(h, w, y):
        return F.cross_entropy((h @ w.t()).float(), y, reduction="none")

    return {"fused": fused, "fused_torch_elementwise": fused_torch_elementwise, "unfused": unfused, "plain": plain}


def measure(fn, n: int, hidden: int, vocab: int, dtype, device, seed: int = 0) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device, dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g).to(device)
    mask = (torch.rand(n, generator=g) < 0.7).float().to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        loss = fn(h, w, y)
        (loss * mask).sum().backward()
        if cuda:
            torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    elapsed = time.perf_counter() - t0
    out = {
        "time_ms": elapsed * 1e3,
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None,
        "loss": loss.detach().float().cpu(),
        "grad_h": h.grad.float().cpu(),
        "grad_w": w.grad.float().cpu(),
    }
    del h, w, y, loss
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=2, help="runs per path (the last is reported; the first warms up)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_loss_memory.py: --device cuda but no CUDA device is visible (use --device cpu for a smoke run)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    from megatron.core import parallel_state as ps

    from multimodal.platform import init_distributed

    init_distributed()
    ps.initialize_model_parallel(1, 1)
    paths = _paths()
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "vocab": args.vocab, "hidden": args.hidden, "seqs": {}}
    for n in args.seqs:
        results = {}
        for name in ("fused", "fused_torch_elementwise", "unfused", "plain"):
            for _ in range(max(args.repeat, 1)):
                results[name] = measure(paths[name], n, args.hidden, args.vocab, dtype, device)
                if "error" in results[name]:
                    break
        ref = results["plain"]
        row = {}
        for name, r in results.items():
            entry = {k: r[k] for k in ("time_ms", "peak_gib", "error") if k in r}
            if "error" not in r and "error" not in ref:
                for key in ("loss", "grad_h", "grad_w"):
                    diff = (r[key] - ref[key]).abs().max().item()
                    entry[f"max_abs_diff_{key}_vs_plain"] = diff
            row[name] = entry
        f, u = row["fused"].get("peak_gib"), row["unfused"].get("peak_gib")
        row["fused_over_unfused_peak"] = f / u if f is not None and u else None
        report["seqs"][str(n)] = row
        _print(n, row)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    ps.destroy_model_parallel()
    return report


def _print(n: int, row: dict) -> None:
    print(f"seq {n}:")
    for name in ("fused", "fused_torch_elementwise", "unfused", "plain"):
        r = row[name]
        if "error" in r:
            print(f"  {name:24s} {r['error']}")
            continue
        peak = "n/a (CPU)" if r["peak_gib"] is None else f"{r['peak_gib']:.2f} GiB"
        print(f"  {name:24s} peak {peak:>12s}  time {r['time_ms']:9.1f} ms  "
              f"max |diff| vs plain: loss {r.get('max_abs_diff_loss_vs_plain', float('nan')):.2e} "
              f"dh {r.get('max_abs_diff_grad_h_vs_plain', float('nan')):.2e} "
              f"dW {r.get('max_abs_diff_grad_w_vs_plain', float('nan')):.2e}")
    ratio = row["fused_over_unfused_peak"]
    if ratio is not None:
        print(f"  fused / unfused peak memory: {ratio:.3f} (target <= 0.25: {'met' if ratio <= 0.25 else 'NOT met'})")


if __name__ == "__main__":
    main()
