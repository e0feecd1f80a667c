"""model.lora and model.freeze under tensor, pipeline, context and expert parallelism (CPU, gloo, 2 processes)
against one process, the way tests/test_parallel.py compares the full-training layouts: same
initial weights (a weights-only checkpoint of a one-process init), same data, the same logged
losses and gradient norms within fp32 tolerance. The LoRA runs start from that base-only
checkpoint with fresh adapters: A is drawn per layer from (seed, global layer name), so every
layout starts from the same adapters.

Plus a fast single-process check of the TP split arithmetic of the checkpointed adapters."""

from __future__ import annotations

import pytest
import torch

from test_hf import _run as _run_script
from test_parallel import DENSE, MOE, ONE_PER_ROW, PACKED, STEPS, _compare, _run, _save_init_weights

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
FREEZE_GROUPS = ["vision", "embedding", "lm_head"]  # frozen weights on both stages (the tied head on the last)
FREEZE = [f"model.freeze=[{','.join(FREEZE_GROUPS)}]"]
ITER = f"iter_{STEPS:07d}"


@pytest.fixture(scope="module")
def base_init(tmp_path_factory, mcore):
    return _save_init_weights(tmp_path_factory.mktemp("base_init"), DENSE, [])


@pytest.fixture(scope="module")
def lora_ref(tmp_path_factory, base_init):
    """One process, LoRA from the base-only init, a checkpoint after the last step."""
    out = tmp_path_factory.mktemp("lora_ref")
    rows = _run(out, DENSE, *PACKED, *LORA, f"checkpoint.load={base_init}", f"checkpoint.dir={out / 'ck'}",
                f"checkpoint.interval={STEPS}")
    return out / "ck" / ITER, rows


def _exports(tmp_path, ckpt, tag: str) -> tuple[dict, dict]:
    """(PEFT adapter tensors, merged fp32 HF weights) that convert_hf exports from a LoRA checkpoint."""
    from safetensors.torch import load_file

    peft, merged = tmp_path / f"peft_{tag}", tmp_path / f"merged_{tag}"
    _run_script("scripts/convert_hf.py", "export", "--ckpt", str(ckpt), "--out", str(peft), "--adapter-only")
    _run_script("scripts/convert_hf.py", "export", "--ckpt", str(ckpt), "--out", str(merged), "--merge-lora",
                "--dtype", "fp32")
    return load_file(str(peft / "adapter_model.safetensors")), load_file(str(merged / "model.safetensors"))


@pytest.mark.slow
def test_lora_tp2_sp_matches_one_process_and_exports_the_same_adapters(tmp_path, base_init, lora_ref):
    """TP=2 with sequence parallelism: column layers split B's rows (the fused qkv groups, fc1's
    gate / up halves, the GDN in_proj sections), row layers split A's columns, the r-wide
    products are gathered / reduce-scattered over TP. The losses match one process, and the TP=2
    checkpoint exports (--adapter-only, --merge-lora) the adapters and merged weights the
    one-process run exports: a wrong row layout would move them by O(1)."""
    ref_ckpt, ref = lora_ref
    got = _run(tmp_path / "tp2", DENSE, *PACKED, *LORA, f"checkpoint.load={base_init}", "parallel.tp=2",
               "parallel.sequence_parallel=true", f"checkpoint.dir={tmp_path / 'ck'}",
               f"checkpoint.interval={STEPS}", nproc=2)
    _compare(ref, got, "lora tp2+sp")
    peft1, merged1 = _exports(tmp_path, ref_ckpt, "tp1")
    peft2, merged2 = _exports(tmp_path, tmp_path / "ck" / ITER, "tp2")
    assert sorted(peft1) == sorted(peft2) and peft1
    assert all(peft1[k].abs().max() > 0 for k in peft1)  # B trained away from zero, A non-zero
    # fp32 reduction-order noise, amplified by Adam, stays far below the adapters' own size
    worst = max(float((peft2[k] - peft1[k]).norm() / peft1[k].norm()) for k in peft1)
    assert sorted(merged1) == sorted(merged2)
    merged_diff = max(float((merged2[k] - merged1[k]).abs().max()) for k in merged1)
    print(f"EXPORT lora tp2+sp vs tp1: adapters worst rel. diff {worst:.3g}, merged max |diff| {merged_diff:.3g}")
    assert worst < 1e-2, worst
    assert merged_diff < 1e-4, merged_diff


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.pp=2"], ["parallel.tp=2"]], ids=["pp2", "tp2"])
def test_lora_pp2_and_tp2_match_one_process(tmp_path, base_init, lora_ref, layout):
    """PP=2: each stage adapts its own layers (A seeded by the global layer number). TP=2 without
    sequence parallelism: the r-wide products all-reduced (row layers) or their gradient
    all-reduced (column layers) instead of reduce-scattered / gathered."""
    got = _run(tmp_path, DENSE, *PACKED, *LORA, f"checkpoint.load={base_init}", *layout, nproc=2)
    _compare(lora_ref[1], got, "lora " + "+".join(layout))


@pytest.mark.slow
def test_freeze_pp2_matches_one_process_and_frozen_weights_stay_bit_identical(tmp_path, base_init, mcore):
    """Frozen weights on both stages: the vision tower and the embedding on the first, the tied
    LM head's copy on the last (megatron's embedding-group gradient sum must leave it alone).
    The losses match one process and every frozen weight in the PP=2 checkpoint equals the init."""
    from models import get_model_builder
    from multimodal import checkpointing
    from multimodal.config import ParallelConfig, load_config

    ref = _run(tmp_path / "ref", DENSE, *PACKED, *FREEZE, f"checkpoint.load={base_init}")
    got = _run(tmp_path / "pp2", DENSE, *PACKED, *FREEZE, f"checkpoint.load={base_init}", "parallel.pp=2",
               f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.interval={STEPS}", nproc=2)
    _compare(ref, got, "freeze pp2")

    cfg = load_config(DENSE)

    def weights(path):
        model = get_model_builder(cfg.model.name)(cfg.model, ParallelConfig(), torch.float32)
        checkpointing.load_weights(checkpointing.resolve(str(path), None), model)
        return model, {n: p.detach().clone() for n, p in model.named_parameters()}

    model, before = weights(base_init)
    _, after = weights(tmp_path / "ck" / ITER)
    frozen = [n for n in before if model.parameter_group(n) in FREEZE_GROUPS]
    trained = [n for n in before if n not in frozen]
    assert any("vision" in n for n in frozen) and any("embedding" in n for n in frozen)
    for n in frozen:
        assert torch.equal(before[n], after[n]), n
    assert sum(not torch.equal(before[n], after[n]) for n in trained) > 0.9 * len(trained)


@pytest.mark.slow
@pytest.mark.parametrize("tuning,layout", [
    (FREEZE, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    # every row split over two ranks (rows padded to a multiple of 2 x cp in both runs)
    (LORA, ["parallel.cp=2"]),
], ids=["freeze_tp2_sp", "lora_cp2"])
def test_tp2_and_cp2_match_one_process(tmp_path, base_init, tuning, layout):
    common = [*PACKED, *tuning, f"checkpoint.load={base_init}", "data.loader.pad_multiple=4"]
    ref = _run(tmp_path / "ref", DENSE, *common)
    got = _run(tmp_path / "two", DENSE, *common, *layout, nproc=2)
    _compare(ref, got, "+".join([*tuning, *layout]))


@pytest.mark.slow
def test_lora_ep2_matches_one_process(tmp_path, mcore):
    """An MoE model under EP=2 with LoRA: adapters on the attention / GDN projections and the
    shared expert, the routed experts frozen (no weight gradient) behind the all-to-all dispatch."""
    init = _save_init_weights(tmp_path / "init", MOE, [])
    common = [*ONE_PER_ROW, *LORA, f"checkpoint.load={init}"]
    ref = _run(tmp_path / "ref", MOE, *common)
    got = _run(tmp_path / "ep2", MOE, *common, "parallel.ep=2", nproc=2)
    _compare(ref, got, "lora ep2")


# ------------------------------------------------------------------ TP split arithmetic (fast)


def _assemble(entries: list) -> dict[str, torch.Tensor]:
    """key -> the global tensor that the ShardedTensors of every rank tile."""
    out = {}
    for sh in entries:
        g = out.setdefault(sh.key, torch.full(sh.global_shape, float("nan")))
        index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, (1,) * sh.prepend_axis_num + sh.local_shape))
        g[index] = sh.data.reshape(g[index].shape)
    return out


def _built(entry) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]


@pytest.mark.parametrize("layout", ["plain_rows", "swiglu", "gdn_sections", "columns"])
def test_split_adapters_checkpoint_as_the_unsplit_matrices(layout):
    """Two TP ranks emulated in one process: each holds its shard of a base weight (in megatron's
    per-rank layout: [gate_r | up_r] for fc1, [q_r, k_r, v_r, z_r, b_r, a_r] for the GDN in_proj)
    and the matching shard of the adapter. The stored tensors that the two ranks' sharded entries
    tile are the one-process weight and adapter, and folding the stored adapter into the stored
    weight equals folding each rank's adapter into its weight shard."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.ssm.utils import _split_tensor_factory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from models.common.lora import merged_state_dict, shard_adapters

    torch.manual_seed(0)
    tp, r, hidden, scale = 2, 3, 8, 2.0
    sections = {"plain_rows": [12], "swiglu": [6, 6], "gdn_sections": [4, 4, 6, 6, 2, 2], "columns": [8]}[layout]
    names = [f"s{i}" for i in range(len(sections))]
    out_full = tp * sum(sections)
    in_full = hidden * (tp if layout == "columns" else 1)
    w, b, a = torch.randn(out_full, in_full), torch.randn(out_full, r), torch.randn(r, in_full)

    def rows_of(rank):  # the one-process rows that megatron's layout puts on this rank, in its order
        idx, start = [], 0
        for n in sections:
            idx += range(start + rank * n, start + (rank + 1) * n)
            start += tp * n
        return torch.tensor(idx)

    entries, local_merged = {"weight": [], "adapter": []}, {}
    for rank in range(tp):
        if layout == "columns":  # row-parallel base layer: the input columns split, B replicated
            cols = slice(rank * hidden, (rank + 1) * hidden)
            w_r, a_r, b_r = w[:, cols].clone(), torch.nn.Parameter(a[:, cols].clone()), b.clone()
            weight = ShardedTensor.from_rank_offsets("l.weight", w_r, (1, rank, tp), replica_id=(0, 0, 0))
            split, key = a_r, "l.lora_A"
            local_merged[rank] = w_r + scale * b_r @ a_r.detach()
        else:  # column-parallel: the output rows split in megatron's layout, A replicated
            idx = rows_of(rank)
            w_r, b_r = w[idx].clone(), torch.nn.Parameter(b[idx].clone())
            weight = ShardedTensor.from_rank_offsets("l.weight", w_r, (0, rank, tp), replica_id=(0, 0, 0))
            if layout == "swiglu":
                weight = apply_swiglu_sharded_factory(weight, ())
            elif layout == "gdn_sections":
                weight = _split_tensor_factory(weight, sections, names, 0)
            split, key = b_r, "l.lora_B"
            local_merged[rank] = w_r + scale * b_r.detach() @ a
        split.lora_sharded_like_weight = True
        replicated = ShardedTensor.from_rank_offsets(key, split, replica_id=(0, rank, 0))  # as megatron leaves it
        sd = shard_adapters({"l.weight": weight, key: replicated})
        entries["weight"] += _built(sd["l.weight"])
        entries["adapter"] += _built(sd[key])
    stored_w, stored_adapter = _assemble(entries["weight"]), _assemble(entries["adapter"])
    assert set(k.replace("lora_A", "weight").replace("lora_B", "weight") for k in stored_adapter) == set(stored_w)
    def whole(stored):  # the GDN sections are stored as <key>.s0, <key>.s1, ...: one after the other
        return torch.cat([stored[k] for k in sorted(stored)])

    assert torch.equal(whole(stored_w), w)
    assert torch.equal(whole(stored_adapter), a if layout == "columns" else b)
    merged = merged_state_dict({"l.weight": w, "l.lora_A": a, "l.lora_B": b}, scale)["l.weight"]
    for rank in range(tp):  # each rank's merged shard is the one-process merge's shard
        shard = merged[:, rank * hidden:(rank + 1) * hidden] if layout == "columns" else merged[rows_of(rank)]
        torch.testing.assert_close(local_merged[rank], shard, rtol=1e-6, atol=1e-5)
