"""The training loop's log steps: the parameter norm as one multi-tensor reduction per dtype, and
the step clock that measures windows without a host sync (the loop itself, whose log lines
are read one step late, is covered end to end by tests/test_training.py: every step's row)."""

from __future__ import annotations

import time

import pytest
import torch

from multimodal.training import _param_norm, _StepClock


def test_param_norm_is_the_norm_of_every_parameter_in_fp32(mcore):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    model[1].to(torch.bfloat16)  # mixed dtypes: grouped, each accumulated in fp32
    with torch.no_grad():
        model[1].weight.mul_(300.0)  # large enough that a bf16 sum of squares would round badly
    want = torch.sqrt(sum(p.detach().double().square().sum() for p in model.parameters()))
    got = _param_norm(model)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_param_norm_counts_a_shared_weight_once(mcore):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False))
    model[1].weight.shared = True  # megatron's mark on the tied output-layer copy
    want = model[0].weight.detach().norm()
    assert _param_norm(model).item() == pytest.approx(want.item(), rel=1e-6)


def test_cpu_step_clock_windows_are_consecutive():
    clock = _StepClock(is_cuda=False)
    first = clock.mark()
    time.sleep(0.02)
    second = clock.mark()
    assert first[1] == second[0]  # no time between windows goes uncounted
    assert clock.seconds(*second) >= 0.02
