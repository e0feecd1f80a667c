"""Run by tests under torchrun: logits of an imported checkpoint under a TP/EP layout.

    torchrun --nproc-per-node N tests/helpers/mp_logits.py CKPT OUT.pt --tp T --ep E [--save-weights DIR]

Every rank feeds the same parity sample; rank 0 writes the full-vocabulary logits to OUT.pt.
With --save-weights the model is also saved (weights-only) under this layout, so tests can
export from a checkpoint written under TP/EP > 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--save-weights")
    args = ap.parse_args()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from models.qwen35_vl.model import build
    from models.qwen35_vl.mrope import mrope_position_ids
    from models.qwen35_vl.parity import parity_inputs
    from multimodal import checkpointing
    from models.common.parallel_config import ParallelConfig
    from multimodal.platform import init_distributed
    from core.seeding import seed_everything
    from scripts.convert_hf import model_config_of_checkpoint

    init_distributed()
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, expert_model_parallel_size=args.ep)
    seed_everything(0)
    path = checkpointing.resolve(args.ckpt, None)
    m = model_config_of_checkpoint(path, None)
    m.attention_backend, m.gdn_backend, m.moe_aux_loss_coeff = "sdpa", "torch", 0.0
    model = build(m, ParallelConfig(tp=args.tp, ep=args.ep), torch.float32)
    checkpointing.load_weights(path, model)
    model.eval()
    input_ids, pixels, grid, _ = parity_inputs(m, seed=0)
    pos = mrope_position_ids(input_ids[0], grid, m.image_token_id, m.vision.spatial_merge_size)[:, None]
    with torch.no_grad():
        logits = model(input_ids, pos, pixel_values=pixels, image_grid_thw=grid)
        logits = gather_from_tensor_model_parallel_region(logits)
    if torch.distributed.get_rank() == 0:
        torch.save(logits, args.out)
    if args.save_weights:
        checkpointing.save_weights(args.save_weights, model, meta_files={
            "hf_config.json": (path / "hf_config.json").read_text()})
    ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
