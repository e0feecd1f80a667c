"""Run by tests/test_hf_slices.py under torchrun: what each rank reads from a Hugging Face folder
when it loads its part of the model directly (checkpoint.load=<HF folder>).

    torchrun --nproc-per-node 2 tests/helpers/mp_hf_slices.py OUT_JSON HF_DIR [HF_DIR ...] tp=2 ep=2

For each folder, first every rank loads the one-process model (TP=PP=EP=1) and checks it read every tensor of the
folder once, no more. Then, per layout, it loads its own part and checks every piece it holds is
bit for bit the piece the whole-read path gives (``hf_to_ours`` on every tensor read whole,
placed by megatron's TP=1 chunk plan: tests/helpers/mp_layout_init.py). Rank 0 writes OUT_JSON:
{folder: {layout: [bytes read per tensor, of each rank], "single": bytes read per tensor}}."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from megatron.core import parallel_state as ps

    from core.safetensors_io import SafetensorsFolder
    from core.seeding import seed_everything
    from helpers.mp_layout_init import _reference_region
    from models import family_for_hf_config, get_hf_adapter
    from models.common.layout_init import sharded_pieces
    from models.common.parallel_config import ParallelConfig
    from multimodal.hf_convert import load_hf_weights, reference_plan
    from multimodal.platform import init_distributed

    out = Path(sys.argv[1])
    folders = [a for a in sys.argv[2:] if "=" not in a]
    layouts = [a for a in sys.argv[2:] if "=" in a]
    init_distributed()
    rank = torch.distributed.get_rank()
    reports = {}
    for hf_dir in folders:
        family = family_for_hf_config(hf_dir)
        adapter = get_hf_adapter(family)
        m = adapter.model_config_from_hf(hf_dir)
        whole = adapter.hf_to_ours(adapter.load_hf_state_dict(hf_dir), m)  # every tensor read whole
        plan = reference_plan(m, family)

        ps.initialize_model_parallel(1, 1)
        seed_everything(0)
        single = load_hf_weights(family.build(m, ParallelConfig(), torch.float32), hf_dir, m, adapter, plan)
        folder = SafetensorsFolder(hf_dir)
        sizes = {n: torch.Size(folder.shape(n)).numel() * folder.dtype(n).itemsize for n in folder.names}
        assert single["read_by_tensor"] == sizes, "one process reads a tensor more than once, or not at all"
        ps.destroy_model_parallel()

        report = {"single": single["read_by_tensor"]}
        for layout in layouts:
            dim, size = layout.split("=")
            p = ParallelConfig(**{dim: int(size)})
            ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                         expert_model_parallel_size=p.ep)
            seed_everything(0)
            model = family.build(m, p, torch.float32)
            got = load_hf_weights(model, hf_dir, m, adapter, plan)
            n = 0
            for name, st in sharded_pieces(model):
                offset, shape = list(st.global_offset), list(st.local_shape)
                for dst, src in _reference_region(whole, plan.chunks[st.key], offset, shape):
                    assert torch.equal(st.data[dst], src.to(st.data.dtype)), f"{layout} rank {rank}: {name} differs"
                    n += st.data[dst].numel()
            held = sum(q.numel() for q in model.parameters())
            assert n == held, f"{layout} rank {rank}: compared {n} of the {held} elements held"
            gathered: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, got["read_by_tensor"])
            report[layout] = gathered
            ps.destroy_model_parallel()
        reports[hf_dir] = report
    if rank == 0:
        out.write_text(json.dumps(reports))


if __name__ == "__main__":
    main()
