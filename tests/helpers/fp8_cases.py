"""What the FP8 kernel tests share: a check script run under Triton's CPU interpreter, torch's scaled GEMM
written out (the fast path's calls on the CPU), and one FP8 linear forward + backward on fixed operands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from models.common import fp8, fp8_gemm

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(script: str):
    """``script`` (python source printing one JSON line last) in a process with TRITON_INTERPRET=1: its
    JSON. The interpreter is chosen when Triton is imported, so it cannot be switched on in this one."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scaled_mm_emulated(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
    """torch._scaled_mm written out: (a * scale_a) @ (b * scale_b), scales 0-dim or [M, 1] / [1, N]."""
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def linear_case(recipe: str):
    """``run(hp_rows, main_grad)``: ``_Fp8Linear`` under ``recipe`` on 1000 tokens of 64 features into 96
    outputs (``hp_rows`` of them kept in high precision, as GDN's), backward from a fixed gradient;
    returns the output, the weight gradient (into a ``main_grad`` of 0.5s when ``main_grad``) and
    the input gradient, in fp32. 1000 tokens: the weight gradient's contraction is padded to 1008."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 64, generator=gen).bfloat16()
    w = (torch.randn(96, 64, generator=gen) * 0.05).bfloat16()
    g = torch.randn(1000, 96, generator=gen).bfloat16()

    def run(hp_rows: int, main_grad: bool):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if main_grad:
            wi.main_grad = torch.full(w.shape, 0.5)
        spec = fp8._Spec(fp8_gemm.RECIPES[recipe], "out", None, hp_rows)
        out = fp8._Fp8Linear.apply(xi, wi, None, spec, main_grad, False, False, None)
        out.backward(g)
        return out.float(), (wi.main_grad if main_grad else wi.grad).float(), xi.grad.float()

    return run
