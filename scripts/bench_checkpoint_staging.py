"""What an async checkpoint save stops training for: the host copy of the state, timed apart.

    python scripts/bench_checkpoint_staging.py [--gib 29] [--tensors 400] [--json OUT]

``--gib`` of GPU tensors (the 2B recipe's model and optimizer state is ~29 GB) in ``--tensors``
equal pieces are staged to host memory three ways, each followed by a device synchronize:
1. megatron's writer: ``tensor.to("cpu", non_blocking=True)`` for every tensor, every save
   (twice: the second finds the first's page-locked blocks in torch's host allocator cache);
2. ``multimodal.async_saves.PinnedStaging`` at its first save (page-locked buffers allocated);
3. the same at a later save (buffers reused: the copy alone).
Then the fork of the writer process with those buffers in this process (the async writer
forks once per save). A save's training stall is about (2 or 3) + the fork.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


from multimodal.async_saves import PinnedStaging  # noqa: E402


def _timed(fn) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def _fork_s() -> float:
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    elapsed = time.perf_counter() - start  # the parent's stall: copying the page tables
    os.waitpid(pid, 0)
    return elapsed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=29.0)
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_checkpoint_staging needs a GPU")
    numel = int(args.gib * 2**30 / 4 / args.tensors)
    tensors = [torch.randn(numel, device="cuda") for _ in range(args.tensors)]
    buckets = [(f"/ckpt/__{i}.distcp", f"__{i}.distcp", ([], [(f"t{j}", t) for j, t in enumerate(tensors[i::8])]))
               for i in range(8)]  # eight writer threads' buckets, as megatron groups them
    megatron = lambda: [t.to("cpu", non_blocking=True) for t in tensors]  # noqa: E731
    megatron_s, host = _timed(megatron)
    del host  # freed page-locked blocks go back to torch's host allocator cache
    megatron_again_s, host = _timed(megatron)
    del host
    staging = PinnedStaging()
    first_s, _ = _timed(lambda: staging(buckets))
    for t in tensors:
        t.add_(1)
    later_s, staged = _timed(lambda: staging(buckets))
    assert torch.equal(staged[0][2][1][0][1], tensors[0].cpu())  # the buffers hold the new values
    out = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "gib": args.gib,
        "tensors": args.tensors, "megatron_to_cpu_s": round(megatron_s, 3),
        "megatron_to_cpu_again_s": round(megatron_again_s, 3),
        "pinned_first_save_s": round(first_s, 3), "pinned_later_save_s": round(later_s, 3),
        "later_save_gb_per_s": round(args.gib * 2**30 / later_s / 1e9, 1), "fork_s": round(_fork_s(), 3),
    }
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
