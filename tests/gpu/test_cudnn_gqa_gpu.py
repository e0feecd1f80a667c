"""cuDNN attention with grouped k/v heads handed over as they are vs repeated (the earlier path),
on a GPU: forward and input gradients, and the time of each.

    python tests/gpu/test_cudnn_gqa_gpu.py [--tokens 8192 --q-heads 8 --kv-heads 2 --head-dim 256]

Both runs are bf16 cuDNN; the reference is the fp32 SDPA math path on fp32 copies. Prints the
worst relative error of each against it (the grouped path must be no worse than the repeated
one, x1.5) and exits 1 otherwise, or if cuDNN refused the grouped heads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch


from models.common import attention as attn  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def run(q, k, v, g, grouped: bool):
    attn._cudnn_gqa_refused.clear()
    if not grouped:
        attn._cudnn_gqa_refused.append("forced off for the comparison")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn._cudnn_dense(q, k, v, True, None)
    out.backward(g)
    grads = [t.grad.clone() for t in (q, k, v)]  # the timed passes below accumulate into .grad
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        attn._cudnn_dense(q, k, v, True, None).backward(g)
    end.record()
    torch.cuda.synchronize()
    return out.detach(), *grads, start.elapsed_time(end) / 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--json", help="write the errors and the verdict as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shape = lambda h: (1, args.tokens, h, args.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), device=dev, dtype=torch.bfloat16)
               for h in (args.q_heads, args.kv_heads, args.kv_heads))
    g = torch.randn(shape(args.q_heads), device=dev, dtype=torch.bfloat16)
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        ref = attn._sdpa_batched(q32, k32, v32, True, None)
    ref.backward(g.float())
    ref_all = (ref.detach(), q32.grad, k32.grad, v32.grad)
    rows = {}
    for name, grouped in (("repeated", False), ("grouped", True)):
        *outs, ms = run(q, k, v, g, grouped)
        rows[name] = [rel(a, b) for a, b in zip(outs, ref_all)]
        print(f"{name:9s} fwd+bwd {ms:6.2f} ms  rel. error out {rows[name][0]:.2e}  dq {rows[name][1]:.2e}  "
              f"dk {rows[name][2]:.2e}  dv {rows[name][3]:.2e}")
    refused = bool(attn._cudnn_gqa_refused)
    worse = [i for i in range(4) if rows["grouped"][i] > 1.5 * rows["repeated"][i] + 1e-6]
    print("cuDNN refused the grouped heads" if refused else
          "PASS" if not worse else f"FAILED: grouped is worse in {worse}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rel_err_out_dq_dk_dv": rows,
                                               "cudnn_refused_grouped": refused, "passed": not (refused or worse)}, indent=1))
    sys.exit(1 if refused or worse else 0)


@pytest.mark.gpu
def test_cudnn_grouped_kv_heads_are_no_worse_than_repeated(run_check):
    """cuDNN takes the grouped k/v heads and is no less exact than with them repeated."""
    run_check(__file__)


if __name__ == "__main__":
    main()
