"""DDP's main_grad adds through the vectorised kernel (multimodal/performance/ddp_grad_add.py): over
micro-batches of the proxy, every main_grad equals megatron's own hook's, the gradient is dropped
and marked added as megatron does, and the cases megatron treats differently stay with its hook.
On the CPU the kernel does not run: its reference (torch's add_, which it equals bit for bit,
tests/test_grouped_experts.py) stands in, so what is checked here is the hook's logic."""

from __future__ import annotations

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from fused_kernels import main_grad_accumulate
from helpers.proxy_fixtures import accumulate, forward, packed_rows, proxy_model
from multimodal.performance.ddp_grad_add import vectorised_grad_adds


def _ddp(model, overlap: bool):
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap)
    with vectorised_grad_adds():
        return DistributedDataParallel(config=model.config, module=model, ddp_config=config)


@pytest.mark.parametrize("overlap", [False, True])
def test_kernel_adds_equal_megatrons_over_micro_batches(mcore, monkeypatch, overlap):
    cfg, model = proxy_model()
    batches = packed_rows(cfg, groups=((0, 1), (2, 3), (4,)))
    ddp = _ddp(model, overlap)
    _, want = accumulate(ddp, model, batches)  # on the CPU the kernel is unavailable: megatron's add_

    added = []
    monkeypatch.setattr(main_grad_accumulate, "available", lambda main, grad: None)
    monkeypatch.setattr(main_grad_accumulate, "accumulate_",
                        lambda main, grad: added.append(main.numel()) or main.add_(grad))
    _, got = accumulate(ddp, model, batches)
    trained = [p for p in model.parameters() if p.requires_grad]
    # every gradient, every micro-batch, through the kernel, but the tied word embedding's, which
    # megatron marks zero_out_wgrad (its hook adds it)
    tied = [p for p in trained if getattr(p, "zero_out_wgrad", False)]
    assert len(tied) == 1 and len(added) == len(batches) * (len(trained) - 1)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert all(p.grad is None and not p.grad_added_to_main_grad for p in trained)
    if overlap:  # the reduction was still launched: megatron's hook marked every weight ready
        ddp.finish_grad_sync()


def test_what_megatron_treats_differently_stays_with_its_hook(mcore, monkeypatch):
    """A gradient a fused backward already added (grad_added_to_main_grad), or one megatron marks
    zero_out_wgrad, is not added by the kernel."""
    cfg, model = proxy_model()
    ddp = _ddp(model, False)
    monkeypatch.setattr(main_grad_accumulate, "available", lambda main, grad: None)
    calls = []
    monkeypatch.setattr(main_grad_accumulate, "accumulate_", lambda main, grad: calls.append(1) or main.add_(grad))
    params = [p for p in model.parameters() if p.requires_grad and not getattr(p, "zero_out_wgrad", False)]
    fused, zero_out = params[0], params[1]
    ddp.zero_grad_buffer()
    fused.grad_added_to_main_grad = True
    zero_out.zero_out_wgrad = True
    batch = packed_rows(cfg)[0]
    (forward(model, batch) * batch["loss_mask"]).sum().backward()
    assert len(calls) == len(params) - 2  # nor the tied word embedding's (zero_out_wgrad from megatron)
    assert not fused.main_grad.any()  # megatron's hook skips it: the fused backward owns that add
    assert zero_out.main_grad.any()  # megatron's hook added it
