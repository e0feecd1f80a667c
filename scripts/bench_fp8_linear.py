"""Time a dense decoder MLP's two linear layers, forward + backward with the weight gradient added
into an fp32 ``main_grad`` (as under ``model.grad_accum_fusion``), in bf16 and under each FP8 recipe,
at a real model's shapes (default: the 9B's, one 8K row).

    python scripts/bench_fp8_linear.py [--tokens 8192 --hidden 4096 --ffn 12288] [--json OUT]

Reports milliseconds per forward + backward (wall time over repeated calls, so a path that keeps
the GPU waiting on the host shows it), the host's own milliseconds per call (the time to issue
the work while the GPU is held busy, so the host never waits for it: where it approaches the wall
time, the path is bound by the host, as an eager step would be), the kernels each path launches
per call, and its kernels by GPU time (where the time goes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fused_kernels.wgrad_accum import added_to_main_grad, wgrad_gemm_accum_fp32  # noqa: E402
from models.common import fp8, fp8_gemm  # noqa: E402
from scripts.bench_fp8_experts import kernel_table, time_ms  # noqa: E402


class _Bf16Linear(torch.autograd.Function):
    """The bf16 baseline: megatron's linear with the weight gradient accumulated into main_grad."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        wgrad_gemm_accum_fp32(x, g, weight.main_grad)
        return g @ weight, added_to_main_grad(weight)


def host_ms(fn, reps: int = 8) -> float:
    """Host milliseconds to issue one call, measured behind a GPU sleep long enough that no call
    waits for the device (a few hundred launches stay well inside the launch queue)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU clock cycles
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / reps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16)
    shapes = {"fc1": (2 * a.ffn, a.hidden), "fc2": (a.hidden, a.ffn)}
    weights = {}
    for name, (out_f, in_f) in shapes.items():
        w = (torch.randn(out_f, in_f, device="cuda") / in_f**0.5).bfloat16().requires_grad_()
        w.main_grad = torch.zeros(out_f, in_f, device="cuda", dtype=torch.float32)
        weights[name] = w
    grad = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16)

    def mlp(linear):
        def run():
            xi = x.detach().requires_grad_()
            h = linear(xi, weights["fc1"])
            gate, up = h.chunk(2, dim=-1)
            linear(torch.nn.functional.silu(gate) * up, weights["fc2"]).backward(grad)
            for w in weights.values():
                w.grad = None
        return run

    def fp8_linear(recipe):
        spec = fp8._Spec(fp8_gemm.RECIPES[recipe], "out", None, 0)
        return lambda xi, w: fp8._Fp8Linear.apply(xi, w, None, spec, True, False, False, None)

    paths = {"bf16": mlp(_Bf16Linear.apply)}
    for recipe in ("tensorwise", "rowwise"):
        paths[f"fp8_{recipe}"] = mlp(fp8_linear(recipe))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": a.tokens,
              "hidden": a.hidden, "ffn": a.ffn}
    for name, run in paths.items():
        result[f"{name}_ms"] = time_ms(run, reps=20, warmup=3)
        result[f"{name}_host_ms"] = host_ms(run)
        table = kernel_table(run)
        result[f"{name}_kernels"] = table["kernels"]
        result[f"{name}_kernel_table"] = table
    for recipe in ("tensorwise", "rowwise"):
        result[f"fp8_{recipe}_speedup"] = result["bf16_ms"] / result[f"fp8_{recipe}_ms"]
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
