"""optimizer.overlap_step (multimodal/performance/overlap_update.py): the flat AdamW step cut into parts in
forward order, gated by forward pre-hooks. On the CPU there is no second stream, so these check
the plan, the gating hooks, the kernel's gradient zeroing and the skipped buffer reset, and that
the parts give the whole step's update bit for bit. The race itself (the update on its own CUDA
stream) is checked on the GPU by tests/gpu/test_overlap_update_gpu.py."""

from __future__ import annotations

import pytest
import torch

from multimodal.performance import overlap_update
from multimodal.config import ConfigError, load_config, validate
from helpers.proxy_fixtures import forward, packed_rows, proxy_model
from test_flat_adamw import _megatron_optimizer


def _unit_names(model, opaque=()):
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m, _ in overlap_update.units(model, opaque)]


def test_units_are_layers_blocks_and_direct_parameter_holders(mcore):
    _, model = proxy_model()
    names = _unit_names(model)
    layers = [n for n in names if n.startswith("language_model.decoder.layers.")]
    assert layers == [f"language_model.decoder.layers.{i}" for i in range(model.config.num_layers)]
    assert any(n.startswith("vision_model.blocks.") for n in names)
    # every trainable parameter is gated by exactly one unit
    gated = [id(p) for _, ps in overlap_update.units(model) for p in ps]
    assert sorted(gated) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    # a vision encoder that replays its blocks as one graph is one unit
    opaque = _unit_names(model, [model.vision_model])
    assert "vision_model" in opaque and not any(n.startswith("vision_model.") for n in opaque)


def _train_steps(model, ddp, opt, rows, steps=3):
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        loss = forward(model, rows[0])
        (loss * rows[0]["loss_mask"]).sum().backward()
        opt.step()
        losses.append(loss.detach().clone())
    return losses


def test_the_update_in_parts_equals_the_whole_update_bit_for_bit(mcore):
    ref_model, ref_ddp, ref_opt, _ = _megatron_optimizer(flat=True)
    model, ddp, opt, (flat,) = _megatron_optimizer(flat=True)
    overlap = overlap_update.overlap_update_with_forward(model, opt, True, pieces=4)
    assert overlap is not None and flat.overlap is overlap
    assert (overlap.stream is None) == (not torch.cuda.is_available())  # CPU: the parts run in order
    cfg, _ = proxy_model()
    rows = packed_rows(cfg, device=next(model.parameters()).device)
    ref_losses = _train_steps(ref_model, ref_ddp, ref_opt, rows)
    losses = _train_steps(model, ddp, opt, rows)
    overlap.finish()  # on a GPU the update may still run on its stream
    # bit for bit on the CPU; on a GPU the backward's atomics differ run to run (the race check
    # there is tests/gpu/test_overlap_update_gpu.py)
    tol = dict(rtol=1e-4, atol=1e-6) if torch.cuda.is_available() else dict(rtol=0, atol=0)
    for a, b in zip(losses, ref_losses):
        torch.testing.assert_close(a, b, **tol)
    for (name, a), (_, b) in zip(sorted(model.named_parameters()), sorted(ref_model.named_parameters())):
        torch.testing.assert_close(a, b, **tol, msg=name)

    # the plan follows the forward: the vision encoder's parts come before the decoder's, each
    # layer's part is not before the previous layer's, and there is more than one part
    part = {n: overlap.piece_of[p] for n, p in model.named_parameters()}
    layer_parts = [max(v for n, v in part.items() if n.startswith(f"language_model.decoder.layers.{i}."))
                   for i in range(model.config.num_layers)]
    assert layer_parts == sorted(layer_parts)
    assert max(v for n, v in part.items() if n.startswith("vision_model.")) <= layer_parts[0]
    assert len(set(part.values())) > 1
    assert sum(len(p) for p in overlap.work[id(flat)]) >= 2

    # the kernel zeroed the gradients it read; the reference's are still there until its reset
    (buf,) = ddp.buffers
    assert not buf.grad_data.any() and ref_ddp.buffers[0].grad_data.any()
    # right after a step the buffer's reset skips its zeroing (the update may still be reading it
    # on its stream); a second reset, with no step between, zeroes as before
    buf.grad_data[0] = 1.0
    ddp.zero_grad_buffer()
    assert buf.grad_data[0] == 1.0
    ddp.zero_grad_buffer()
    assert not buf.grad_data.any()

    overlap.close()  # hooks and resets are given back
    assert flat.overlap is None and not model._forward_pre_hooks
    buf.grad_data[0] = 1.0
    ddp.zero_grad_buffer()
    assert not buf.grad_data.any()


def test_install_refuses_what_it_cannot_overlap(mcore, caplog):
    _, _, opt, _ = _megatron_optimizer(flat=False)
    _, model = proxy_model()
    assert overlap_update.overlap_update_with_forward(model, opt, True) is None
    assert "needs flat AdamW" in caplog.text
    model, _, opt, _ = _megatron_optimizer(flat=True)
    if not torch.cuda.is_available():
        assert overlap_update.overlap_update_with_forward(model, opt, None) is None  # the default on a CPU: the step stays
    assert overlap_update.overlap_update_with_forward(model, opt, False) is None


@pytest.mark.parametrize("overrides, words", [
    (["optimizer.overlap_step=true", "optimizer.flat=false"], "set optimizer.flat"),
    (["optimizer.overlap_step=true", "parallel.use_distributed_optimizer=true"], "distributed optimizer"),
    (["optimizer.overlap_step_pieces=0"], "optimizer.overlap_step_pieces must be >= 1"),
])
def test_config_refuses_overlap_it_cannot_run(overrides, words):
    cfg = load_config("configs/qwen35_vl_proxy.yaml", overrides)
    with pytest.raises(ConfigError, match=words):
        validate(cfg)


@pytest.mark.slow
def test_trainer_with_the_step_overlapped_trains_bit_for_bit_like_without(clipped_proxy_runs):
    """The entry point, flat AdamW (its PyTorch reference here) with and without the overlap,
    clipping active; the log steps' parameter norm goes through ``behind_update``."""
    overlapped, plain = clipped_proxy_runs("overlap"), clipped_proxy_runs("no_overlap")
    assert len(overlapped) == 4 and all(r["grad_norm"] > 0.05 for r in overlapped)
    for a, b in zip(overlapped, plain):
        for key in ("loss", "grad_norm", "param_norm"):
            assert a[key] == b[key], (key, a, b)
