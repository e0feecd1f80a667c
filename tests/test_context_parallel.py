"""Context parallelism: zigzag split, per-sample padding, and CP=2/4 against the CP=1 run on the
same weights and packed data (per-token losses, summed loss, every gradient), THD and BSHD,
through GDN and gated attention layers and the vision scatter; then the trainer end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.collate import pack_thd
from data.loader import MicroBatchIterator
from data.mock import MockDataset
from multimodal.config import ConfigError, load_config, validate
from core.zigzag import zigzag_indices
from multimodal.context_parallel import partition_batch
from test_training import _free_port, _train

ROOT = Path(__file__).resolve().parents[1]


def test_zigzag_split_is_balanced_and_covers_every_token_once():
    segments = [8, 16, 24]
    for cp in (2, 4):
        parts = [zigzag_indices(segments, cp, r) for r in range(cp)]
        assert sorted(torch.cat(parts).tolist()) == list(range(sum(segments)))
        for r, idx in enumerate(parts):
            assert len(idx) == sum(segments) // cp  # same share of every sample on every rank
            chunk = 16 // (2 * cp)  # sample 2 starts at 8 and has 16 tokens
            own = idx[(8 // cp): (8 // cp) + 16 // cp].tolist()
            assert own == list(range(8 + r * chunk, 8 + (r + 1) * chunk)) + \
                list(range(8 + (2 * cp - 1 - r) * chunk, 8 + (2 * cp - r) * chunk))
    with pytest.raises(ValueError, match="pad every sample to a multiple of 4"):
        zigzag_indices([6, 10], 2, 0)


@pytest.fixture(scope="module")
def proxy():
    cfg = load_config(ROOT / "configs/qwen35_vl_proxy.yaml")
    return cfg, MockDataset(cfg.model, cfg.data, 256)


def _kw(m):
    return dict(pad_id=m.pad_token_id, image_token_id=m.image_token_id, merge=m.vision.spatial_merge_size)


def test_pack_pads_each_sample_inside_its_segment(proxy):
    cfg, ds = proxy
    samples = [ds[i] for i in range(3)]
    lengths = [len(s["input_ids"]) for s in samples]
    b = pack_thd(samples, 512, pad_multiple=8, **_kw(cfg.model))
    padded = [-(-n // 8) * 8 for n in lengths]
    assert b["cu_seqlens_padded"].tolist()[: 4] == [0, *torch.tensor(padded).cumsum(0).tolist()]
    assert b["cu_seqlens"].tolist()[: 4] == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    start = 0
    for s, n, p in zip(samples, lengths, padded):
        assert torch.equal(b["tokens"][0, start:start + n], s["input_ids"])
        assert b["loss_mask"][0, start + n:start + p].sum() == 0  # padding is never trained
        start += p
    assert b["sample_lengths"] == lengths and b["num_real_tokens"] == sum(lengths)

    it = MicroBatchIterator(ds, 512, cfg.model.pad_token_id, cfg.model.image_token_id, 2, True, 1, 0, 1,
                            pad_multiple=8)
    for _ in range(3):
        row = next(it)
        segs = (row["cu_seqlens_padded"][1:] - row["cu_seqlens_padded"][:-1]).tolist()
        assert all(s % 8 == 0 for s in segs) and sum(segs) == 512


def test_partition_routes_image_features_to_the_rank_holding_their_tokens(proxy):
    cfg, ds = proxy
    m = cfg.model
    b = pack_thd([ds[i] for i in range(3)], 512, pad_multiple=4, **_kw(m))
    n_image = int((b["tokens"] == m.image_token_id).sum())
    features = torch.arange(n_image)  # feature row i belongs to the i-th image token of the row
    full = torch.full(b["tokens"].shape, -1)
    full[b["tokens"] == m.image_token_id] = features
    for r in range(2):
        part = partition_batch(b, 2, r, m.image_token_id)
        local = torch.full(part["tokens"].shape, -1)
        local[part["tokens"] == m.image_token_id] = features[part["image_feature_index"]]
        idx = zigzag_indices(b["cu_seqlens_padded"].diff().tolist(), 2, r)
        assert torch.equal(local, full[:, idx])
        assert torch.equal(part["position_ids"], b["position_ids"][:, :, idx])
        order = part["cp_gather_order"]
        assert torch.equal(order[part["cp_restore_order"]], torch.arange(512))


def test_split_vision_gives_each_image_to_one_rank_and_restores_batch_order(proxy):
    cfg, ds = proxy
    m = cfg.model
    b = pack_thd([ds[i] for i in range(3)], 512, pad_multiple=8, **_kw(m))
    n_images, merge = b["image_grid_thw"].shape[0], m.vision.spatial_merge_size
    rows = b["image_grid_thw"].prod(dim=1)
    # stand-in "features": one row per merged token, numbered in batch order
    feats = torch.arange(int((rows // merge**2).sum()))
    starts = [0, *rows.cumsum(0).tolist()]
    seen, gathered = [], []
    for r in range(4):
        part = partition_batch(b, 4, r, m.image_token_id, split_vision=True, merge=merge)
        own = part["vision_images"]
        seen += own
        assert torch.equal(part["pixel_values"],
                           torch.cat([b["pixel_values"][starts[i]:starts[i + 1]] for i in own] + [b["pixel_values"][:0]]))
        assert part["pixel_values"].shape[0] == int(part["image_grid_thw"].prod(dim=1).sum())
        # what this rank's encoder would output for its images, padded to the gather width
        f_starts = [0, *(rows // merge**2).cumsum(0).tolist()]
        mine = torch.cat([feats[f_starts[i]:f_starts[i + 1]] for i in own]) if own else feats[:0]
        width = part["vision_gather_width"]
        gathered.append(torch.cat([mine, torch.full((width - len(mine),), -1)]))
    assert sorted(seen) == list(range(n_images))  # every image encoded exactly once
    assert torch.equal(torch.cat(gathered)[part["vision_gather_index"]], feats)


def test_layouts_that_cannot_split_are_refused():
    cfg = load_config(ROOT / "configs/qwen35_vl_proxy.yaml", ["parallel.cp=2", "train.seq_length=510"])
    with pytest.raises(ConfigError, match="multiple of 2\\*cp = 4"):
        validate(cfg, world_size=2)
    cfg = load_config(ROOT / "configs/qwen35_vl_proxy.yaml", ["parallel.cp=4"])
    with pytest.raises(ConfigError, match="linear_num_key_heads \\(2\\) must be divisible by parallel.tp\\*cp \\(4\\)"):
        validate(cfg, world_size=4)
    cfg = load_config(ROOT / "configs/qwen35_vl_proxy.yaml", ["parallel.cp=8", "model.linear_num_key_heads=8",
                                                              "model.linear_num_value_heads=8"])
    with pytest.raises(ConfigError, match="num_attention_heads \\(4\\) must be divisible by parallel.tp\\*cp"):
        validate(cfg, world_size=8)


def _torchrun(nproc: int, *args: str, interpret: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if interpret:  # the fused Triton kernels run on CPU through Triton's interpreter
        env["TRITON_INTERPRET"] = "1"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={_free_port()}", "tests/helpers/mp_cp.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _compare(single: dict, parallel: dict) -> None:
    torch.testing.assert_close(parallel["losses"], single["losses"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parallel["loss"], single["loss"], rtol=1e-6, atol=1e-4)
    if single.get("mtp") is not None:  # the MTP loss sum and its token count
        torch.testing.assert_close(parallel["mtp"], single["mtp"], rtol=1e-6, atol=1e-4)
    for name, g in single["grads"].items():
        assert g.abs().sum() > 0 or "bias" in name, name  # the comparison covers real gradients
        # fp32 sums in another order (4-rank all-reduces; the vision tower on a subset of the images
        # with split vision): worst seen 1.8e-6 absolute on one element of the tied embedding
        torch.testing.assert_close(parallel["grads"][name], g, rtol=1e-4, atol=1e-5, msg=name)


# GDN heads that split 4 ways (grouped value heads kept: 2 per key head); attention keeps 4 query
# heads and 2 KV groups, so CP=4 also exercises the KV-head repeat.
CP4 = ("model.linear_num_key_heads=4", "model.linear_num_value_heads=8")
FUSED = ("model.gdn_pre_impl=fused", "model.fused_mrope=true")  # fused pre-GDR on head groups, MRoPE
MTP = ("model.mtp_num_layers=1",)  # the shifted MTP inputs split over CP like the tokens


@pytest.mark.slow
@pytest.mark.parametrize("cp,layout,overrides", [(2, "thd", MTP), (2, "bshd", ()), (4, "thd", CP4),
                                                 (4, "thd-split-vision", CP4), (2, "thd", FUSED)],
                         ids=["cp2-thd-mtp", "cp2-bshd", "cp4-thd", "cp4-split-vision", "cp2-fused"])
def test_context_parallel_matches_one_process(tmp_path, cp, layout, overrides):
    init = tmp_path / "init.pt"
    flags = {"bshd": ["--bshd"], "thd-split-vision": ["--split-vision"]}.get(layout, [])
    interpret = overrides == FUSED
    _torchrun(1, str(tmp_path / "single.pt"), "--init", str(init), *flags, *overrides, interpret=interpret)
    _torchrun(cp, str(tmp_path / "parallel.pt"), "--init", str(init), *flags, *overrides, interpret=interpret)
    _compare(torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "parallel.pt"))


@pytest.mark.slow
def test_trainer_with_cp2_logs_the_losses_of_one_process(tmp_path):
    """The proxy recipe, unchanged but parallel.cp=2, on 2 processes: same losses step by step
    (the weights start equal: CP ranks are replicas and the init does not depend on cp)."""
    common = ("train.iters=3", "train.seq_length=256", "data.mock.max_image_side=64", "data.mock.max_text_tokens=48",
              "checkpoint.dir=null", "model.attention_backend=sdpa", "model.gdn_backend=torch")
    # same row packing in both runs: every sample padded to a multiple of 4 (what cp=2 needs)
    single = _train(tmp_path / "one", *common, "parallel.cp=1", "data.loader.pad_multiple=4")
    parallel = _train(tmp_path / "two", *common, "parallel.cp=2", nproc=2)
    for step in single:
        assert abs(parallel[step]["loss"] - single[step]["loss"]) < 1e-4, (step, single, parallel)
        assert abs(parallel[step]["grad_norm"] - single[step]["grad_norm"]) < 1e-4 * single[step]["grad_norm"]
