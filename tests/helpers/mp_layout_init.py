"""Layout-independent initial weights (models/common/layout_init.py), checked under torchrun.

``check_layouts(layouts, seed)`` runs inside a 2-process launch: for each (config, layout) every
rank builds the one-process model (TP=PP=EP=1) and its own part of the layout's model, gives both
the layout-independent init of ``seed``, and checks every piece the rank holds is bit for bit the
piece of the one-process model's parameter it stands for. Which piece that is comes from
megatron's TP=1 chunk plan (``multimodal.hf_convert.reference_plan``: key, offset and the view of
the named TP=1 parameter), not from the code under test. Returns the number of elements compared
on this rank per layout.
"""

from __future__ import annotations

import torch


def _reference_region(ref: dict, chunks: list, offset: list[int], shape: list[int]) -> list[tuple]:
    """(destination slices, source tensor) for each TP=1 chunk overlapping [offset, offset+shape)."""
    out = []
    for c in chunks:
        lo = [max(a, b) for a, b in zip(offset, c.offset)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(offset, shape, c.offset, c.shape)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        size, stride, storage_offset = c.view
        data = ref[c.param].as_strided(size, stride, storage_offset)
        src = data[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, c.offset))]
        out.append((tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offset)), src))
    return out


def check_layouts(layouts: list[tuple[str, str]], seed: int) -> dict[str, int]:
    from megatron.core import parallel_state as ps

    from core.seeding import seed_everything
    from models import get_model_family
    from models.common.layout_init import init_layout_independent, sharded_pieces
    from models.common.parallel_config import ParallelConfig
    from multimodal.config import load_config, resolve_sources
    from multimodal.hf_convert import reference_plan

    rank = torch.distributed.get_rank()
    compared = {}
    for config, layout in layouts:
        m = resolve_sources(load_config(config, [])).model
        family = get_model_family(m.name)
        ps.initialize_model_parallel(1, 1)
        seed_everything(seed)
        reference = family.build(m, ParallelConfig(), torch.float32)
        init_layout_independent(reference, seed)
        ref = {n: p.detach() for n, p in reference.named_parameters()}
        plan = reference_plan(m, family)
        ps.destroy_model_parallel()

        dim, size = layout.split("=")
        p = ParallelConfig(**{dim: int(size)})
        ps.initialize_model_parallel(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
                                     expert_model_parallel_size=p.ep)
        seed_everything(seed + 1 + rank)  # megatron's own draw differs per rank on purpose: it must not matter
        stage = ps.get_pipeline_model_parallel_rank()
        model = family.build(m, p, torch.float32, pre_process=stage == 0, post_process=stage == p.pp - 1)
        init_layout_independent(model, seed)
        n = 0
        for name, st in sharded_pieces(model):
            regions = _reference_region(ref, plan.chunks[st.key], list(st.global_offset), list(st.local_shape))
            for dst, src in regions:
                got = st.data[dst]
                assert torch.equal(got, src), f"{config} {layout} rank {rank}: {name} ({st.key}) differs"
                n += got.numel()
        held = sum(q.numel() for q in model.parameters())
        assert n == held, f"{config} {layout} rank {rank}: compared {n} of the {held} elements held"
        compared[f"{config} {layout}"] = n
        ps.destroy_model_parallel()
    return compared
