"""Run by tests under torchrun: direct Hugging Face loading (checkpoint.load=<HF folder>) against
import-then-load, under several layouts in one launch.

    torchrun --nproc-per-node 2 tests/helpers/mp_hf_load.py HF_DIR CKPT tp=2 pp=2 ep=2 [--export=DIR]

For each layout every rank builds its part of the model twice, fills one from the HF folder and one
from the imported dist-checkpoint, and checks every tensor it holds is bit-for-bit the same
(the same weights give the same losses); rank 0 prints one line per layout. --export: then every
rank writes its share of the imported checkpoint's HF shards (checkpoint.save_hf's path)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from megatron.core import parallel_state as ps

    from core.seeding import seed_everything
    from models import get_hf_adapter, get_model_family
    from models.common.parallel_config import ParallelConfig
    from multimodal import checkpointing
    from multimodal.hf_convert import load_hf_weights, reference_plan
    from multimodal.platform import init_distributed
    from scripts.convert_hf import model_config_of_checkpoint

    hf_dir, ckpt = sys.argv[1], checkpointing.resolve(sys.argv[2], None)
    layouts = [a for a in sys.argv[3:] if not a.startswith("--export=")]
    export = [a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("--export=")]
    init_distributed()
    for layout in layouts:
        dim, size = layout.split("=")
        p = ParallelConfig(**{dim: int(size)})
        m = model_config_of_checkpoint(ckpt, None)
        family = get_model_family(m.name)
        plan = reference_plan(m, family)  # before the layout's parallel state
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                     expert_model_parallel_size=p.ep)
        seed_everything(0)
        stage, stages = ps.get_pipeline_model_parallel_rank(), p.pp
        built = [family.build(m, p, torch.float32, pre_process=stage == 0, post_process=stage == stages - 1)
                 for _ in range(2)]
        counts = load_hf_weights(built[0], hf_dir, m, get_hf_adapter(family), plan)
        checkpointing.load_weights(ckpt, built[1])
        direct, imported = built[0].state_dict(), built[1].state_dict()
        names = [k for k in direct if not k.endswith("_extra_state")]
        differ = [k for k in names if not torch.equal(direct[k], imported[k])]
        assert not differ, f"{layout} rank {torch.distributed.get_rank()}: {len(differ)} tensors differ, e.g. {differ[0]}"
        total = torch.tensor([len(names)])
        torch.distributed.all_reduce(total)
        if torch.distributed.get_rank() == 0:
            print(f"{layout}: {int(total)} tensors equal ({counts['tensors']} pieces read on rank 0)", flush=True)
        ps.destroy_model_parallel()
    if export:
        import json

        from multimodal.hf_convert import export_hf

        ps.initialize_model_parallel(1, 1)
        seed_everything(0)
        m = model_config_of_checkpoint(ckpt, None)
        family = get_model_family(m.name)
        export_hf(ckpt, export[0], m, get_hf_adapter(family), family, None,
                  json.loads((ckpt / "hf_config.json").read_text()), 200_000, rank=torch.distributed.get_rank(),
                  world=torch.distributed.get_world_size())
        ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
