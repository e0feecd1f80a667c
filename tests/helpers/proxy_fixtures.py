"""The proxy model, packed mock rows and a DDP wrapper, seeded the same way for every test that
compares two ways of running the model (graphs, recompute, fused kernels) on the CPU."""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from data.collate import pack_thd
from data.mock import MockDataset
from models import get_model_builder, get_model_family
from multimodal.config import load_config
from multimodal.forward_step import packed_seq_params, to_device

PROXY = "configs/qwen35_vl_proxy.yaml"
ROW = 384  # tokens per packed row


def proxy_model(overrides=(), config: str = PROXY):
    """(cfg, fp32 model built from seed 0); needs megatron's parallel state (the mcore fixture)."""
    from core.seeding import seed_everything

    cfg = load_config(config, list(overrides))
    seed_everything(0)
    return cfg, get_model_builder(cfg.model.name)(cfg.model, cfg.parallel, torch.float32)


def packed_rows(cfg, groups=((0, 1),), device="cpu") -> list[dict]:
    """One packed row of ROW tokens per group of mock-sample indices."""
    m = cfg.model
    ds = MockDataset(m, cfg.data, 256)
    extras = get_model_family(m.name).packed_row_extras
    return [to_device(pack_thd([ds[i] for i in idx], ROW, m.pad_token_id, m.image_token_id,
                               m.vision.spatial_merge_size), torch.device(device), torch.float32, row_extras=extras)
            for idx in groups]


def wrap_ddp(model) -> DistributedDataParallel:
    """megatron's DDP with fp32 main_grad buffers, as the trainer builds it."""
    return DistributedDataParallel(config=model.config, module=model,
                                   ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def forward(model, batch) -> torch.Tensor:
    """Per-token losses of one packed row."""
    return model(batch["tokens"], batch["position_ids"], labels=batch["labels"], pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"], packed_seq_params=packed_seq_params(batch))


def accumulate(ddp, model, batches):
    """Losses of each micro-batch, then main_grad of the trained weights after all of them
    (gradient accumulation; frozen weights have none)."""
    ddp.zero_grad_buffer()
    losses = []
    for batch in batches:
        loss = forward(model, batch)
        (loss * batch["loss_mask"]).sum().backward()
        losses.append(loss.detach())
    return losses, {n: p.main_grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def optimizer_steps(cfg, model, ddp, optimizer, scheduler, steps: int) -> list[torch.Tensor]:
    """Per-step summed losses of ``steps`` full optimizer steps (what the trainer does per step:
    zeroed buffers, backward, DDP's gradient sync, the update) on the first packed row, repeated."""
    batch = packed_rows(cfg)[0]
    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = (forward(model, batch) * batch["loss_mask"]).sum()
        loss.backward()
        losses.append(loss.detach().clone())
        ddp.finish_grad_sync()
        optimizer.step()
        scheduler.step(1)
    return losses
