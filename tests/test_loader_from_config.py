"""MicroBatchIterator.from_config: the one place a recipe's sections become the loader's arguments."""

from __future__ import annotations

import torch

from data.loader import MicroBatchIterator
from data.registry import build_dataset
from multimodal.config import load_config

PROXY = "configs/qwen35_vl_proxy.yaml"


def test_from_config_reads_every_argument_from_the_sections():
    cfg = load_config(PROXY, ["data.loader.pack_lookahead=3", "data.loader.max_bad_fraction=0.3", "data.loader.pad_multiple=8",
                              "data.loader.num_workers=null", "train.seq_length=256"])
    m, d, t = cfg.model, cfg.data, cfg.train
    dataset = build_dataset(m, d, t.seq_length)
    it = MicroBatchIterator.from_config(dataset, m, d, t, dp_rank=1, dp_size=2)
    assert (it.seq_length, it.pad_id, it.image_token_id, it.merge) == (
        256, m.pad_token_id, (m.image_token_id, m.video_token_id), m.vision.spatial_merge_size)
    assert (it.pack, it.micro_batch_size, it.dp_rank, it.dp_size) == (True, 1, 1, 2)
    assert (it.max_bad_fraction, it.num_workers, it.pad_multiple, it.lookahead, it.one_pass) == (0.3, 0, 8, 3, False)
    # the layout's multiple, where given, replaces data.loader.pad_multiple (it already includes it)
    assert MicroBatchIterator.from_config(dataset, m, d, t, pad_multiple=24, one_pass=True).pad_multiple == 24
    # and the rows are those of the constructor called with the same values
    spelled = MicroBatchIterator(dataset, 256, m.pad_token_id, m.vision_token_ids, m.vision.spatial_merge_size, True,
                                 1, 1, 2, max_bad_fraction=0.3, pad_multiple=8, pack_lookahead=3)
    for _ in range(2):
        a, b = next(it), next(spelled)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                            for k in a)
    assert it.state_dict() == spelled.state_dict()
