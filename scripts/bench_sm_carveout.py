"""Can the optimizer update hide behind the forward's GEMMs if the GEMMs leave it a few SMs?

Why: ``optimizer.overlap_step`` runs flat AdamW (bandwidth-bound, ~17.5 ms for the 2B on an
H200) on a low-priority stream beside the next forward (compute-bound GEMMs). The GEMM kernels
take every SM, so the two mostly take turns: the overlap gained ~1% (session 11). cuBLASLt can
be told to use fewer SMs (PyTorch: ``torch._C._set_sm_carveout_experimental``); then the update
could run on the SMs left over while the GEMMs run slightly slower.

What it prints, per carveout (SMs withheld from the GEMMs; 0 = off):
- ``gemm``: a chain of forward-sized GEMMs alone;
- ``both``: the same chain with the AdamW update launched beside it on a low-priority stream
  (the wall time until both are done), and what the overlap hid: adamw + gemm - both.
The AdamW alone (no carveout applies to it) is printed once.

    python scripts/bench_sm_carveout.py --carveouts 0,8,16,24,32 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.flat_adamw import chunk_table, flat_adamw  # noqa: E402


def gemm_chain(tokens: int, hidden: int, ffn: int, layers: int, device):
    """A decoder forward's GEMMs (bf16): per layer [T, H] x [H, 2F], [T, F] x [F, H], [T, H] x [H, 3H]."""
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(tokens, ffn, device=device, dtype=torch.bfloat16)
    w_up = torch.randn(2 * ffn, hidden, device=device, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(hidden, ffn, device=device, dtype=torch.bfloat16) * 0.02
    w_qkv = torch.randn(3 * hidden, hidden, device=device, dtype=torch.bfloat16) * 0.02

    def run():
        for _ in range(layers):
            torch.nn.functional.linear(x, w_qkv)
            torch.nn.functional.linear(x, w_up)
            torch.nn.functional.linear(h, w_down)
    return run


def adamw_update(numel: int, device):
    """Flat AdamW over ``numel`` parameters (fp32 master, grad, moments; bf16 model copy)."""
    bufs = [torch.zeros(numel, device=device) for _ in range(4)]
    out = torch.zeros(numel, device=device, dtype=torch.bfloat16)
    table = chunk_table([(0, 0, numel)], device)

    def run():
        flat_adamw(*bufs, out, *table, lr=1e-4, weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8,
                   step=1, grad_scale=None, zero_grad=False, use_kernel=True)
    return run


def timed(fn, reps: int) -> float:
    """Median ms of ``reps`` runs of ``fn`` (which may use several streams)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--carveouts", default="0,8,16,24,32")
    ap.add_argument("--params", type=float, default=2.2e9, help="parameters the update covers")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=6144)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sm_carveout: needs a CUDA device")
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is None:
        sys.exit(f"bench_sm_carveout: this torch ({torch.__version__}) has no _set_sm_carveout_experimental")
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gemms = gemm_chain(args.tokens, args.hidden, args.ffn, args.layers, dev)
    update = adamw_update(int(args.params), dev)
    side = torch.cuda.Stream(priority=0)  # as optimizer.overlap_step: low priority
    main_stream = torch.cuda.Stream(priority=-1)  # as the graphs' compute stream: high priority

    def both():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        main_stream.wait_stream(cur)
        with torch.cuda.stream(side):
            update()
        with torch.cuda.stream(main_stream):
            gemms()
        cur.wait_stream(side)
        cur.wait_stream(main_stream)

    update(), gemms()  # compile / warm
    adamw_ms = timed(update, args.reps)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; AdamW over {args.params / 1e9:.2f}G params alone: "
          f"{adamw_ms:.2f} ms")
    rows = []
    for c in (int(x) for x in args.carveouts.split(",")):
        setter(c or None)
        gemms()
        g = timed(gemms, args.reps)
        b = timed(both, args.reps)
        rows.append({"carveout_sms": c, "gemm_ms": g, "both_ms": b, "hidden_ms": adamw_ms + g - b})
        print(f"  carveout {c:3d} SMs: gemm {g:7.2f} ms   gemm+adamw {b:7.2f} ms   "
              f"hidden {adamw_ms + g - b:6.2f} ms of {adamw_ms:.2f}   cost vs no carveout "
              f"{b - rows[0]['gemm_ms']:6.2f} ms")
    setter(None)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "sms": sms,
                                               "adamw_ms": adamw_ms, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
