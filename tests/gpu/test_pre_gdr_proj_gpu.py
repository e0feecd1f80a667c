"""The fused pre-GDR path that takes the whole in_proj output (``fused_pre_gdr_from_proj``, one
gradient tensor out) against the path on ``torch.split`` views (autograd then cats dqkv, dz,
db, da), on a GPU at the 2B shapes: every output and gradient must be bit-identical (the same
kernels), and both are timed forward+backward.

    python tests/gpu/test_pre_gdr_proj_gpu.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch


from fused_kernels import fused_pre_gdr as fp  # noqa: E402


def run(path: str, proj, w, a_log, dt, cu, dims, cot):
    nk, nv, K, V = dims
    proj, w, a_log, dt = (t.detach().clone().requires_grad_() for t in (proj, w, a_log, dt))
    view = proj.transpose(0, 1)
    if path == "split":
        qk, vd = nk * K, nv * V
        qkv, z, b, a = torch.split(view, [2 * qk + vd, vd, nv, nv], dim=-1)
        outs = (*fp.fused_pre_gdr(qkv, b, a, w, a_log, dt, cu, nk, K, V), z)
    else:
        outs = fp.fused_pre_gdr_from_proj(view, w, a_log, dt, cu, nk, K, V, nv)
    loss = sum((o.float() * c).sum() for o, c in zip(outs, cot))
    loss.backward()
    return [o.detach() for o in outs] + [proj.grad, w.grad, a_log.grad, dt.grad]


def timed(path, *args) -> float:
    run(path, *args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        run(path, *args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--json", help="write each case's result as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, S = torch.device("cuda"), args.tokens
    nk, nv, K, V = 16, 16, 128, 128
    C = 2 * nk * K + nv * V
    D = C + nv * V + 2 * nv
    ok, cases = True, {}
    for name, B, cu in (("one row of 3 samples", 1, torch.tensor([0, 3000, 3001, S], dtype=torch.int32, device=dev)),
                        ("dense, 2 rows", 2, None)):
        proj = torch.randn(S, B, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(C, 4, device=dev, dtype=torch.bfloat16) * 0.5
        a_log, dt = torch.rand(nv, device=dev) * 2 - 1, torch.randn(nv, device=dev)
        dims = (nk, nv, K, V)
        probe = fp.fused_pre_gdr_from_proj(proj.transpose(0, 1), w, a_log, dt, cu, nk, K, V, nv)
        cot = [torch.randn(o.shape, device=dev) for o in probe]
        a = run("split", proj, w, a_log, dt, cu, dims, cot)
        b = run("proj", proj, w, a_log, dt, cu, dims, cot)
        same = [torch.equal(x, y) for x, y in zip(a, b)]
        ok &= all(same)
        t_split, t_proj = (timed(p, proj, w, a_log, dt, cu, dims, cot) for p in ("split", "proj"))
        cases[name] = {"bit_identical": f"{sum(same)}/{len(same)}", "split_ms": t_split, "whole_projection_ms": t_proj}
        print(f"{name}: bit-identical outputs+grads {sum(same)}/{len(same)}; fwd+bwd (incl. the test loss) "
              f"split {t_split:.3f} ms, whole projection {t_proj:.3f} ms")
    print("PASS" if ok else "FAILED")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": cases, "passed": ok},
                                              indent=1))
    sys.exit(0 if ok else 1)


@pytest.mark.gpu
def test_pre_gdr_from_the_whole_projection_is_bit_identical(run_check):
    """The pre-GDR kernel reading the whole projection equals the split path bit for bit."""
    run_check(__file__)


if __name__ == "__main__":
    main()
