"""Data pipeline: HF patch layout, mock samples, loss mask, THD/BSHD collation, resumable dp loader."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data.collate import pack_thd, pad_bshd
from models.common.vision_patches import patchify
from data.loader import MicroBatchIterator, build_dataset
from data.mock import MockDataset
from models.qwen35_vl.mrope import mrope_position_ids
from models.qwen35_vl.config import ModelConfig
from multimodal.config import DataConfig

M = ModelConfig()
D = DataConfig()
S = 512
MERGE = M.vision.spatial_merge_size


@pytest.fixture(scope="module")
def ds():
    return MockDataset(M, D, S)


def _collate_args(seq_length=S):
    return dict(seq_length=seq_length, pad_id=M.pad_token_id, image_token_id=M.image_token_id, merge=MERGE)


# ---------------------------------------------------------------- patchify


def test_patchify_matches_hf_layout():
    p, tp, m = 16, 2, 2
    img = torch.rand(3, 64, 96, generator=torch.Generator().manual_seed(0))
    pv, thw = patchify(img, p, tp, m)
    gh, gw = 4, 6
    assert thw.tolist() == [1, gh, gw] and thw.dtype == torch.long
    assert pv.shape == (gh * gw, 3 * tp * p * p) and pv.dtype == torch.float32
    norm = (img - 0.5) / 0.5

    def reference(r, c):  # patch at patch-row r, patch-col c: features ordered (C, t, y, x)
        block = norm[:, r * p : (r + 1) * p, c * p : (c + 1) * p]
        return block[:, None].expand(3, tp, p, p).reshape(-1)

    # HF order: merge windows row-major, then the m x m patches inside a window row-major.
    # Patch (r=1, c=2): window (0, 1), inside (1, 0) -> row ((0*3 + 1)*2 + 1)*2 + 0 = 6.
    assert torch.equal(pv[6], reference(1, 2))
    # Patch (r=3, c=5): window (1, 2), inside (1, 1) -> row ((1*3 + 2)*2 + 1)*2 + 1 = 23.
    assert torch.equal(pv[23], reference(3, 5))
    for r in range(gh):
        for c in range(gw):
            row = (((r // m) * (gw // m) + c // m) * m + r % m) * m + c % m
            assert torch.equal(pv[row], reference(r, c)), (r, c)


def test_patchify_rejects_bad_size():
    with pytest.raises(ValueError, match="40x64"):
        patchify(torch.rand(3, 40, 64), 16, 2, 2)


# ---------------------------------------------------------------- mock dataset


def test_mock_is_deterministic(ds):
    a, b = ds[7], MockDataset(M, D, S)[7]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
    other = MockDataset(M, dataclasses.replace(D, seed=D.seed + 1), S)[7]
    assert not torch.equal(a["input_ids"], other["input_ids"]) or not torch.equal(a["pixel_values"], other["pixel_values"])


def test_mock_sample_structure(ds):
    for i in range(20):
        s = ds[i]
        ids, n = s["input_ids"], len(s["input_ids"])
        assert n <= S and s["index"] == i
        assert s["labels"].shape == s["loss_mask"].shape == (n,) and s["position_ids"].shape == (3, n)
        assert s["loss_mask"].dtype == torch.float32
        assert torch.equal(s["labels"][:-1], ids[1:]) and s["labels"][-1] == -100
        grids = s["image_grid_thw"]
        assert D.mock.min_images <= len(grids) <= D.mock.max_images
        assert int((ids == M.image_token_id).sum()) == int((grids.prod(1) // MERGE**2).sum())
        assert s["pixel_values"].shape == (int(grids.prod(1).sum()), 3 * 2 * 16 * 16)
        assert torch.equal(s["position_ids"], mrope_position_ids(ids, grids, M.image_token_id, MERGE))
        assert ids[0] == M.im_start_token_id and ids[-1] == M.im_end_token_id
        text = ids[(ids < M.image_token_id)]
        assert (text >= 0).all()


def test_loss_mask_is_answer_plus_closing_im_end(ds):
    for i in range(10):
        s = ds[i]
        ids, n = s["input_ids"].tolist(), len(s["input_ids"])
        a = max(j for j, t in enumerate(ids) if t == M.im_start_token_id)  # assistant im_start
        assert ids[a + 1] == ds.assistant_id
        # labels at t are ids[t+1]: the answer starts at ids[a+2], so the mask starts at a+1,
        # and ends at n-2, whose label is the closing im_end (ids[n-1]).
        expected = torch.zeros(n)
        expected[a + 1 : n - 1] = 1
        assert torch.equal(s["loss_mask"], expected), i
        masked = s["labels"][s["loss_mask"].bool()].tolist()
        assert masked[-1] == M.im_end_token_id
        # the answer is the class spans of the images, in order
        rest, k = masked[:-1], 0
        while rest:
            match = [ans for ans in ds.answers if rest[: len(ans)] == ans]
            assert match, f"sample {i}: answer is not a sequence of class spans"
            rest, k = rest[len(match[0]) :], k + 1
        assert k == len(s["image_grid_thw"])


def test_reply_text_is_supervised_after_the_class_answers(ds):
    """data.mock.reply_text_tokens appends that much filler to each reply, trained on; the rest of
    the sample (images, prompt, class answers) is the sample without it."""
    n = 40
    mock = dataclasses.replace(D.mock, reply_text_tokens=n)
    long = MockDataset(M, dataclasses.replace(D, mock=mock), S)
    for i in range(5):
        a, b = ds[i], long[i]
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
        k = len(a["input_ids"]) - 1  # a's closing im_end: b holds a without it, then the reply text
        assert torch.equal(b["input_ids"][:k], a["input_ids"][:k]) and len(b["input_ids"]) == k + n + 1
        reply = b["input_ids"][k : k + n]
        assert (reply < M.image_token_id).all() and b["input_ids"][-1] == M.im_end_token_id
        assert b["loss_mask"].sum() == a["loss_mask"].sum() + n
        assert b["loss_mask"][k - 1 : k + n].all()  # labels of the reply text and of the closing im_end
    with pytest.raises(ValueError, match="reply_text_tokens must be >= 0"):
        dataclasses.replace(D.mock, reply_text_tokens=-1).validate()


def test_sample_that_cannot_fit_raises():
    with pytest.raises(ValueError, match=r"mock sample 0: .*train\.seq_length=10"):
        MockDataset(M, D, 10)[0]
    # text shrinks to fit when the images fit
    small = MockDataset(M, dataclasses.replace(D, mock=dataclasses.replace(D.mock, min_text_tokens=90, max_text_tokens=96)), 64)
    assert all(len(small[i]["input_ids"]) <= 64 for i in range(10))


# ---------------------------------------------------------------- collation


def test_pack_thd(ds):
    samples = [ds[i] for i in range(3)]
    lens = [len(s["input_ids"]) for s in samples]
    seq = sum(lens) + 10
    b = pack_thd(samples, **_collate_args(seq))
    assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == (1, seq)
    assert b["position_ids"].shape == (3, 1, seq)
    cu = [0, lens[0], lens[0] + lens[1], sum(lens), seq]
    assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].tolist() == cu
    assert b["max_seqlen"] == max(lens + [10]) and b["sample_lengths"] == lens and b["num_real_tokens"] == sum(lens)
    pad = torch.full((10,), M.pad_token_id)
    assert torch.equal(b["tokens"][0], torch.cat([s["input_ids"] for s in samples] + [pad]))
    for i, s in enumerate(samples):  # positions restart at every sample
        assert torch.equal(b["position_ids"][:, 0, cu[i] : cu[i + 1]], s["position_ids"])
        assert b["position_ids"][0, 0, cu[i]] == 0
        assert torch.equal(b["loss_mask"][0, cu[i] : cu[i + 1]], s["loss_mask"])
    assert torch.equal(b["position_ids"][:, 0, sum(lens) :], torch.arange(10).expand(3, 10))
    assert (b["loss_mask"][0, sum(lens) :] == 0).all()
    assert (b["labels"] >= 0).all() and (b["labels"] < M.vocab_size).all()
    assert b["labels"][0, lens[0] - 1] == M.pad_token_id and b["loss_mask"][0, lens[0] - 1] == 0
    assert torch.equal(b["pixel_values"], torch.cat([s["pixel_values"] for s in samples]))
    assert torch.equal(b["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in samples]))
    exact = pack_thd(samples, **_collate_args(sum(lens)))  # no padding -> no extra segment
    assert exact["cu_seqlens"].tolist() == cu[:-1]


def test_pad_bshd(ds):
    samples = [ds[i] for i in range(3)]
    b = pad_bshd(samples, **_collate_args())
    assert b["tokens"].shape == b["labels"].shape == b["loss_mask"].shape == (3, S)
    assert b["position_ids"].shape == (3, 3, S)
    assert b["cu_seqlens"] is None and b["max_seqlen"] is None
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        assert torch.equal(b["tokens"][i, :n], s["input_ids"]) and (b["tokens"][i, n:] == M.pad_token_id).all()
        assert (b["loss_mask"][i, n:] == 0).all()
        assert torch.equal(b["position_ids"][:, i, :n], s["position_ids"])
    assert (b["labels"] >= 0).all()


def test_collate_errors(ds):
    s = ds[0]
    n = len(s["input_ids"])
    for fn in (pack_thd, pad_bshd):
        with pytest.raises(ValueError, match=f"sample 0 has {n} tokens, more than seq_length={n - 1}"):
            fn([s], **_collate_args(n - 1))
    with pytest.raises(ValueError, match="more than seq_length"):
        pack_thd([ds[0], ds[1]], **_collate_args(n + 1))
    bad = dict(s, input_ids=s["input_ids"].clone())
    bad["input_ids"][int((bad["input_ids"] == M.image_token_id).nonzero()[0])] = 5
    for fn in (pack_thd, pad_bshd):
        with pytest.raises(ValueError, match="sample 0: .* image tokens"):
            fn([bad], **_collate_args())


# ---------------------------------------------------------------- loader


class _Recording(torch.utils.data.Dataset):
    """Wraps a dataset and records the indices read."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.reads.append(i)
        return self.inner[i]


def _iterator(dataset, pack, rank=0, dp=1, mbs=1):
    return MicroBatchIterator(dataset, S, M.pad_token_id, M.image_token_id, MERGE, pack=pack,
                              micro_batch_size=mbs, dp_rank=rank, dp_size=dp)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k


@pytest.mark.parametrize("pack", [True, False])
def test_loader_resume(pack):
    small = MockDataset(M, dataclasses.replace(D, mock=dataclasses.replace(D.mock, num_samples=13)), S)  # small: wraps around
    mbs = 1 if pack else 2
    it = _iterator(small, pack, rank=1, dp=2, mbs=mbs)
    for _ in range(5):
        next(it)
    state = it.state_dict()
    assert state["next_index"] % 2 == 1 and (not pack or state["next_index"] > 13)  # wrapped around
    continued = [next(it) for _ in range(4)]
    resumed = _iterator(small, pack, rank=1, dp=2, mbs=mbs)
    resumed.load_state_dict(state)
    for a, b in zip(continued, [next(resumed) for _ in range(4)]):
        _same(a, b)


def test_loader_packs_greedily_in_shard_order(ds):
    it = _iterator(ds, pack=True, rank=0, dp=2)
    batches = [next(it) for _ in range(4)]
    lengths = [n for b in batches for n in b["sample_lengths"]]
    shard = [len(ds[i]["input_ids"]) for i in range(0, 2 * len(lengths), 2)]
    assert lengths == shard  # nothing skipped, nothing repeated
    for b, nxt in zip(batches, batches[1:]):  # greedy: the next row's first sample did not fit
        assert b["num_real_tokens"] + nxt["sample_lengths"][0] > S
    assert it.state_dict() == {"next_index": 2 * len(lengths), "pending": []}


def _packed_indices(ds, batch, by_tokens):
    """The dataset index of each sample in a packed row, found by its token ids."""
    starts = batch["cu_seqlens_padded"].tolist()
    return [by_tokens[tuple(batch["tokens"][0, a:a + n].tolist())] for a, n in zip(starts, batch["sample_lengths"])]


def test_lookahead_packing_takes_each_sample_once_oldest_first_and_fills_rows_fuller(ds):
    rows = 12
    it = MicroBatchIterator(ds, S, M.pad_token_id, M.image_token_id, MERGE, True, 1, 0, 2, pack_lookahead=4)
    by_tokens = {tuple(ds[i]["input_ids"].tolist()): i for i in range(0, 200, 2)}
    assert len(by_tokens) == 100  # token ids identify the samples
    packed, real = [], 0
    for _ in range(rows):
        b = next(it)
        ids = _packed_indices(ds, b, by_tokens)
        # the row opens with the oldest sample not packed yet: none waits for ever
        assert ids[0] == min(i for i in range(0, 200, 2) if i not in packed)
        packed += ids
        real += b["num_real_tokens"]
    state = it.state_dict()
    assert len(state["pending"]) == 4
    # every sample read is packed exactly once or still pending, in this rank's shard
    assert sorted(packed + state["pending"]) == list(range(0, state["next_index"], 2))
    greedy = _iterator(ds, pack=True, rank=0, dp=2)
    assert real > sum(next(greedy)["num_real_tokens"] for _ in range(rows))


def test_lookahead_packing_resumes_exactly_with_its_read_ahead_samples(ds):
    def loader():
        return MicroBatchIterator(ds, S, M.pad_token_id, M.image_token_id, MERGE, True, 1, 1, 2, pack_lookahead=5)

    it = loader()
    for _ in range(3):
        next(it)
    state = it.state_dict()
    assert state["pending"] and all(i % 2 == 1 and i < state["next_index"] for i in state["pending"])
    continued = [next(it) for _ in range(4)]
    resumed = loader()
    resumed.load_state_dict(state)
    for a, b in zip(continued, [next(resumed) for _ in range(4)]):
        _same(a, b)
    # a state from a run with lookahead, resumed without it: the pending samples still come first
    plain = _iterator(ds, pack=True, rank=1, dp=2)
    plain.load_state_dict(state)
    by_tokens = {tuple(ds[i]["input_ids"].tolist()): i for i in range(1, 201, 2)}
    first = _packed_indices(ds, next(plain), by_tokens)
    assert first[0] == state["pending"][0] and set(first) <= set(state["pending"])


def test_dp_ranks_read_disjoint_samples(ds):
    r0, r1 = _Recording(ds), _Recording(ds)
    it0, it1 = _iterator(r0, True, rank=0, dp=2), _iterator(r1, True, rank=1, dp=2)
    for _ in range(3):
        next(it0), next(it1)
    assert r0.reads and r1.reads and not set(r0.reads) & set(r1.reads)
    assert all(i % 2 == 0 for i in r0.reads) and all(i % 2 == 1 for i in r1.reads)


def test_build_dataset():
    assert isinstance(build_dataset(M, D, S), MockDataset)
    with pytest.raises(ValueError, match="'webdataset'"):
        build_dataset(M, dataclasses.replace(D, name="webdataset"), S)


def test_image_class_is_visible(ds):
    """The learnable signal: an image's class is recoverable from its pixels (mean colour)."""
    rng = np.random.default_rng(0)
    for c in range(D.mock.num_classes):
        mean = ds._image(rng, c, 32, 64).mean(dim=(1, 2)).numpy()
        assert int(np.argmin(np.linalg.norm(ds.colours - mean, axis=1))) == c


# ---------------------------------------------------------------- background prefetch


def test_prefetcher_prepares_each_batch_in_its_thread_and_the_vision_geometry_is_then_cached(ds):
    """The family's host work (Qwen3.5: the vision geometry of each image size) runs in the prefetch
    thread, so the encoder's call on the training thread computes nothing new."""
    import threading

    from data.prefetch import Prefetcher
    from models import get_model_family
    from models.qwen35_vl import vision_geometry as vg

    family = get_model_family(M.name)
    threads, batches = [], []

    def prepare(batch):
        threads.append(threading.current_thread().name)
        family.prepare_host_batch(batch, M)

    vg._image_geometry.cache_clear()
    fetched = Prefetcher(MicroBatchIterator(ds, S, M.pad_token_id, M.image_token_id, MERGE, True, 1, 0, 1),
                         depth=2, pin_memory=False, prepare=prepare)
    try:
        batches = [next(fetched) for _ in range(3)]
    finally:
        fetched.close()
    assert threads and set(threads) == {"batch-prefetch"}
    grids = torch.cat([b["image_grid_thw"] for b in batches])
    assert grids.numel() and (grids[:, 1:] > 0).all()
    misses = vg._image_geometry.cache_info().misses
    side = M.vision.grid_side
    for b in batches:
        geo = vg.vision_geometry(b["image_grid_thw"], MERGE, side, "cpu")
        assert geo.interp_index.shape[0] == int(b["image_grid_thw"].prod(1).sum())
    assert vg._image_geometry.cache_info().misses == misses  # every image size was ready


def test_prefetcher_yields_the_same_batches_and_reports_consumed_state(ds):
    from data.prefetch import Prefetcher

    def loader():
        return MicroBatchIterator(ds, S, M.pad_token_id, M.image_token_id, MERGE, True, 1, 0, 1)

    plain, fetched = loader(), Prefetcher(loader(), depth=3, pin_memory=False)
    try:
        for _ in range(4):
            a, b = next(plain), next(fetched)
            assert torch.equal(a["tokens"], b["tokens"]) and a["sample_lengths"] == b["sample_lengths"]
            # the state is that of the batches handed out, although more were built already
            assert fetched.state_dict() == plain.state_dict()
    finally:
        fetched.close()


def test_prefetcher_counts_the_time_the_trainer_waits_for_a_slow_loader():
    """data_wait_s: a loader slower than the trainer shows as waiting; batches built ahead do not."""
    import time

    from data.prefetch import Prefetcher

    class Slow:
        def __init__(self, delay):
            self.delay = delay

        def state_dict(self):
            return {}

        def __next__(self):
            time.sleep(self.delay)
            return {"x": 1}

    slow = Prefetcher(Slow(0.05), depth=1, pin_memory=False)
    try:
        for _ in range(4):
            next(slow)
        assert slow.wait_s >= 0.1  # each batch was requested before the thread had built it
    finally:
        slow.close()
    ahead = Prefetcher(Slow(0.0), depth=2, pin_memory=False)
    try:
        time.sleep(0.2)  # the queue fills while the trainer works
        next(ahead)
        assert ahead.wait_s == 0.0
    finally:
        ahead.close()


def test_prefetcher_raises_loader_errors_in_the_trainer():
    from data.prefetch import Prefetcher

    class Broken:
        def state_dict(self):
            return {}

        def __next__(self):
            raise ValueError("sample 7 is longer than train.seq_length")

    p = Prefetcher(Broken(), pin_memory=False)
    with pytest.raises(ValueError, match="sample 7"):
        next(p)
    p.close()


def test_bench_loader_times_real_image_files():
    """--images: real JPEG/PNG files decoded, resized and patchified at the recipe's pixel range."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "scripts/bench_loader.py", "--config", "configs/qwen35_vl_proxy.yaml",
                           "--images", "4", "--sides", "40,120", "data.min_pixels=1024", "data.max_pixels=4096"],
                          capture_output=True, text=True, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["images"] == 4 and r["images_per_s_per_worker"] > 0 and 0 < r["decode_share"] < 1
    # every image lands in [min_pixels, max_pixels]: 4 to 16 patches of 16 px
    assert 4 <= r["mean_patches_per_image"] <= 16


def test_mock_text_never_holds_a_special_id_of_a_real_vocabulary():
    """Mock text ids lie below every special id, the video placeholder's included: with the 2B
    recipe's ids a stray placeholder in the text would not match the sample's vision grids."""
    from multimodal.config import load_config

    cfg = load_config("configs/qwen35_vl_2b.yaml", ["data.mock.max_image_side=224", "data.mock.min_image_side=224",
                                                   "train.seq_length=512", "data.mock.min_text_tokens=64",
                                                   "data.mock.max_text_tokens=256"])
    m = cfg.model
    ds = MockDataset(m, cfg.data, cfg.train.seq_length)
    for i in range(8):
        ids = ds[i]["input_ids"]
        assert not (ids == m.video_token_id).any()
        image_tokens = int((ids == m.image_token_id).sum())
        assert image_tokens == int(ds[i]["image_grid_thw"].prod(-1).sum()) // m.vision.spatial_merge_size**2


def test_default_decode_workers_follow_the_cores_of_each_gpu_rank(monkeypatch):
    """data.loader.num_workers: null -> up to 4 workers per GPU rank, two cores left to the trainer; none on CPU."""
    import os

    from data.loader import default_num_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_num_workers(False) == 0
    assert default_num_workers(True, local_world_size=1) == 4  # the 16-core, one-H200 machine
    assert default_num_workers(True, local_world_size=4) == 2
    assert default_num_workers(True, local_world_size=8) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")  # torchrun's, when not given
    assert default_num_workers(True) == 1
