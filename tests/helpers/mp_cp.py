"""Run by tests under torchrun: per-token losses and gradients of one packed batch under context
parallelism, to compare with the single-process run on the same weights and data.

    torchrun --nproc-per-node CP tests/helpers/mp_cp.py OUT.pt --init INIT.pt [--bshd] [key=value ...]

Every rank builds the proxy model, loads INIT.pt (written by the first, CP=1 run, so all
layouts start from the same weights), takes its share of the batch, and runs forward and
backward of the summed masked loss. Rank 0 writes the full-length per-token losses (gathered
over CP with ``gather_sequence``), the summed loss, and every parameter's gradient summed over
the CP ranks (what DDP's all-reduce over the data x context group produces). With
model.mtp_num_layers the batch goes through the trainer's ForwardStep and loss (the summed loss
then holds the MTP term), and rank 0 also writes the MTP [loss sum, tokens] summed over CP.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PAD_MULTIPLE = 8  # 2*cp for cp = 4: every layout packs the very same row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--init", required=True)
    ap.add_argument("--bshd", action="store_true")
    ap.add_argument("--split-vision", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from data.collate import pack_thd, pad_bshd
    from data.mock import MockDataset
    from models import get_model_builder
    from multimodal.config import load_config
    from models.common.cp_collectives import gather_sequence
    from multimodal.forward_step import ForwardStep, packed_seq_params, partition_batch, vision_gather
    from multimodal.platform import init_distributed
    from core.seeding import seed_everything

    init_distributed()
    cp = dist.get_world_size()
    ps.initialize_model_parallel(context_parallel_size=cp)
    cfg = load_config(ROOT / "configs/qwen35_vl_proxy.yaml", args.overrides + [f"parallel.cp={cp}"])
    m = cfg.model
    m.attention_backend, m.gdn_backend = "sdpa", "torch"
    seed_everything(0)
    model = get_model_builder(m.name)(m, cfg.parallel, torch.float32)
    init = Path(args.init)
    if init.exists():
        model.load_state_dict(torch.load(init))
    elif cp == 1:
        torch.save(model.state_dict(), init)
    else:
        raise SystemExit(f"{init} is missing: run the CP=1 case first")

    ds = MockDataset(m, cfg.data, 256)
    kw = dict(pad_id=m.pad_token_id, image_token_id=m.image_token_id, merge=m.vision.spatial_merge_size)
    samples = [ds[i] for i in range(3)]
    if args.bshd:
        batch = pad_bshd(samples, 256, **kw)
    else:
        batch = pack_thd(samples, 512, pad_multiple=PAD_MULTIPLE, **kw)
    whole = batch
    if cp > 1:
        batch = partition_batch(batch, cp, ps.get_context_parallel_rank(), m.image_token_id,
                                split_vision=args.split_vision, merge=m.vision.spatial_merge_size)
    params = packed_seq_params(batch, ps.get_context_parallel_group())
    mtp = None
    if m.mtp_num_layers:  # through the trainer's ForwardStep, which shifts the MTP inputs before the split
        step = ForwardStep(torch.device("cpu"), torch.float32, cp_size=cp, cp_rank=ps.get_context_parallel_rank(),
                           cp_group=ps.get_context_parallel_group(), image_token_id=m.vision_token_ids,
                           cp_split_vision=args.split_vision, merge=m.vision.spatial_merge_size)
        losses, loss_fn = step(iter([whole]), model)
        loss, _, report = loss_fn(losses)
        mtp = report["mtp loss"]
    else:
        losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                       pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                       packed_seq_params=params, image_feature_index=batch.get("image_feature_index"),
                       vision_gather=vision_gather(batch, ps.get_context_parallel_group()))
        loss = (losses * batch["loss_mask"]).sum()
    loss.backward()
    full_losses = gather_sequence(losses, params) if cp > 1 else losses.detach()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if cp > 1:
            dist.all_reduce(g, group=ps.get_context_parallel_group())
        grads[name] = g
    total = loss.detach().clone()
    if cp > 1:
        dist.all_reduce(total, group=ps.get_context_parallel_group())
        if mtp is not None:
            dist.all_reduce(mtp, group=ps.get_context_parallel_group())
    if dist.get_rank() == 0:
        torch.save({"losses": full_losses, "loss": total, "grads": grads, "mtp": mtp}, args.out)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
