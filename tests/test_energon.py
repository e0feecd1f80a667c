"""data.name=energon: Megatron-Energon prepared folders written at test time (tar shards +
.nv-meta by energon's own prepare API), read as conversations.

The reference is data.name=conversations on the same records: token ids, labels, loss masks,
MRoPE ids, pixel values and grids equal sample for sample, and the loader's rows equal row for
row, per data-parallel rank and across a resume."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from data.conversations import ConversationsDataset
from data.energon import EnergonDataset
from data.energon_config import EnergonConfig
from data.energon_write import write_energon_dataset
from data.loader import MicroBatchIterator
from multimodal.config import DataConfig
from test_conversations import _jsonl, _png, model_cfg, tok, tok_dir, write_synthetic_conversations  # noqa: F401

SEQ = 1024
PIXELS = dict(min_pixels=1024, max_pixels=16384)  # small images: each test takes a second or two


def _data(name: str, path: Path, tok_dir: Path, **kw) -> DataConfig:
    return DataConfig(name=name, path=str(path), tokenizer=str(tok_dir), **PIXELS, **kw)


def _records(tmp: Path) -> list:
    """Both record forms, 0-2 images, multi-turn, an embedded image, a system prompt, a video of
    frames, and three that the conversations reader skips (missing image, undecodable image, no
    answer)."""
    records = write_synthetic_conversations(tmp, n=8)
    data_url = "data:image/png;base64," + __import__("base64").b64encode(_png(99)).decode()
    (tmp / "images" / "broken.png").write_bytes(b"not an image")
    frames = [f"images/frame{k}.png" for k in range(4)]
    for k, rel in enumerate(frames):
        (tmp / rel).write_bytes(_png(50 + k, 64, 64))
    return records + [
        {"video": frames, "conversations": [{"from": "human", "value": "<video>\nWhat moves?"},
                                            {"from": "gpt", "value": "Nothing."}]},
        {"messages": [{"role": "system", "content": "You read receipts."},
                      {"role": "user", "content": [{"type": "image", "image": data_url},
                                                   {"type": "text", "text": "Sum?"}]},
                      {"role": "assistant", "content": "12"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/none.png"}]},
                      {"role": "assistant", "content": "x"}]},
        {"image": "images/broken.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                                          {"from": "gpt", "value": "y"}]},
        {"messages": [{"role": "user", "content": "Hi"}]},
    ]


@pytest.fixture(scope="module")
def sets(tmp_path_factory, tok_dir, model_cfg, tok):
    """(conversations dataset, energon dataset) of the same 13 records, in 5 shards."""
    tmp = tmp_path_factory.mktemp("energon")
    jsonl = _jsonl(tmp / "train.jsonl", _records(tmp))
    folder = write_energon_dataset(jsonl, tmp / "energon", samples_per_shard=3)
    conv = ConversationsDataset(model_cfg, _data("conversations", jsonl, tok_dir), SEQ, tok)
    eng = EnergonDataset(model_cfg, _data("energon", folder, tok_dir), SEQ, tok)
    return conv, eng


def _assert_same_sample(a: dict | None, b: dict | None) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def test_samples_equal_the_conversations_path(sets):
    conv, eng = sets
    assert len(eng) == len(conv) == 13 and len(list(Path(eng.path).glob("*.tar"))) == 5
    for i in range(len(conv)):
        _assert_same_sample(conv[i], eng[i])
    assert conv[0]["pixel_values"].shape[0] == 0 and conv[2]["image_grid_thw"].shape[0] == 2  # 0 and 2 images
    assert conv[8]["video_grid_thw"].tolist() == [[2, 4, 4]]  # the 4 frames: one video part, as frame parts
    # the bad records are skipped and counted as the conversations reader counts them
    assert dict(eng.skipped) == dict(conv.skipped) == {"missing_image": 1, "bad_image": 1, "empty_answer": 1}


def _assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], torch.Tensor):
                assert torch.equal(x[key], y[key]), key


class _Seen(torch.utils.data.Dataset):
    """A dataset that records the indices read from it."""

    def __init__(self, inner):
        self.inner, self.read = inner, []
        self.skipped = inner.skipped

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.read.append(i)
        return self.inner[i]


def test_data_parallel_ranks_read_disjoint_samples_and_equal_rows(sets, model_cfg):
    conv, eng = sets
    ids = (model_cfg.image_token_id, model_cfg.video_token_id)
    for rank in range(2):
        reading = _Seen(eng)
        it = MicroBatchIterator(reading, SEQ // 2, 0, ids, 2, True, 1, dp_rank=rank, dp_size=2, max_bad_fraction=0.5)
        rows = [next(it) for _ in range(3)]
        ref = MicroBatchIterator(conv, SEQ // 2, 0, ids, 2, True, 1, dp_rank=rank, dp_size=2, max_bad_fraction=0.5)
        _assert_same_rows(rows, [next(ref) for _ in range(3)])
        # disjoint, and together every sample once per pass: rank r reads r, r+2, ... then wraps around
        assert reading.read[:len(range(rank, len(eng), 2))] == list(range(rank, len(eng), 2))


def test_resume_continues_where_the_loader_stopped(sets, model_cfg):
    """Six rows in one go equal three, a saved state, and three more from a new iterator, with
    decode workers in the resumed one (each worker opens its own shard files)."""
    _, eng = sets
    ids = (model_cfg.image_token_id, model_cfg.video_token_id)

    def loader(**kw):
        return MicroBatchIterator(eng, SEQ // 2, 0, ids, 2, True, 1, dp_rank=1, dp_size=2, max_bad_fraction=0.5,
                                  pack_lookahead=3, **kw)

    full = loader()
    rows = [next(full) for _ in range(6)]  # past the end of the set: the second pass wraps around
    first = loader()
    _assert_same_rows([next(first) for _ in range(3)], rows[:3])
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = loader(num_workers=2)
    resumed.load_state_dict(state)
    _assert_same_rows([next(resumed) for _ in range(3)], rows[3:])


def _tar(folder: Path, samples: list[dict[str, bytes]], dataset_yaml: str) -> Path:
    """One shard of ``samples`` (part name -> bytes) prepared with energon's API, and its dataset.yaml."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    folder.mkdir(parents=True)
    with tarfile.open(folder / "data-0.tar", "w") as tar:
        for i, parts in enumerate(samples):
            for ext, data in parts.items():
                info = tarfile.TarInfo(f"{i:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    BaseWebdatasetFactory.prepare_dataset(folder, ["data-0.tar"], split_parts_ratio=[("train", 1.0)],
                                          shuffle_seed=None, workers=1)
    (folder / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml)
    return folder


def test_vqa_and_captioning_samples_become_conversations(tmp_path, tok_dir, model_cfg, tok):
    """energon's VQASample (the answer of highest weight) and CaptioningSample (with a prompt),
    declared by field_map as `energon prepare` writes it, equal the conversations they stand for."""
    pngs = [_png(i, 32 + 16 * i, 64) for i in range(3)]
    qa = [("What colour?", ["red", "blue"], [0.2, 0.8]), ("How many?", ["two"], None), ("Which?", [], None)]
    vqa = _tar(tmp_path / "vqa", [{"png": p, "json": json.dumps({"q": q, "a": a, "w": w}).encode()}
                                  for p, (q, a, w) in zip(pngs, qa)],
               "sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
               "field_map:\n  image: png\n  context: json[q]\n  answers: json[a]\n  answer_weights: json[w]\n")
    cap = _tar(tmp_path / "cap", [{"png": p, "txt": f"A picture number {i}.".encode()} for i, p in enumerate(pngs)],
               "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
               "field_map:\n  image: png\n  caption: txt\n")
    (tmp_path / "img").mkdir()
    for i, p in enumerate(pngs):
        (tmp_path / "img" / f"{i}.png").write_bytes(p)

    def chat(i, prompt, answer):
        user = [{"type": "image", "image": f"img/{i}.png"}] + ([{"type": "text", "text": prompt}] if prompt else [])
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}

    expected_vqa = [chat(0, "What colour?", "blue"), chat(1, "How many?", "two"), chat(2, "Which?", "")]
    expected_cap = [chat(i, "Describe it.", f"A picture number {i}.") for i in range(3)]
    for folder, expected, kw in ((vqa, expected_vqa, {}),
                                 (cap, expected_cap, {"energon": EnergonConfig(caption_prompt="Describe it.")})):
        conv = ConversationsDataset(model_cfg, _data("conversations", _jsonl(tmp_path / "c.jsonl", expected), tok_dir),
                                    SEQ, tok)
        eng = EnergonDataset(model_cfg, _data("energon", folder, tok_dir, **kw), SEQ, tok)
        assert len(eng) == 3
        for i in range(3):
            _assert_same_sample(conv[i], eng[i])
        assert dict(eng.skipped) == dict(conv.skipped) == ({"empty_answer": 1} if folder == vqa else {})


def test_missing_or_unprepared_folder_is_one_line_naming_the_fix(tmp_path, tok_dir, model_cfg, tok):
    (tmp_path / "r.jsonl").write_text("")
    for path, says in ((tmp_path / "absent", "does not exist"), (tmp_path, f"run `energon prepare {tmp_path}`"),
                       (tmp_path / "r.jsonl", "a conversations file: data.name=conversations")):
        with pytest.raises(ValueError) as e:
            EnergonDataset(model_cfg, _data("energon", path, tok_dir), SEQ, tok)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    folder = write_energon_dataset(_jsonl(tmp_path / "r.jsonl", write_synthetic_conversations(tmp_path, n=2)),
                                   tmp_path / "e")
    with pytest.raises(ValueError, match="Invalid split part: 'val'.*data.energon.split_part='val'"):
        EnergonDataset(model_cfg, _data("energon", folder, tok_dir, energon=EnergonConfig(split_part="val")), SEQ, tok)
    other = EnergonDataset(model_cfg, _data("energon", folder, tok_dir, energon=EnergonConfig(record_part="txt")),
                           SEQ, tok)
    assert other[0] is None and dict(other.skipped) == {"bad_record": 1}  # no such part: skipped and counted
    (folder / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type:\n  __module__: megatron.energon\n  __class__: ImageSample\nfield_map:\n  image: json\n")
    with pytest.raises(ValueError, match="holds energon ImageSample samples; data.name=energon reads CrudeSample"):
        EnergonDataset(model_cfg, _data("energon", folder, tok_dir), SEQ, tok)


def test_validation_reads_the_folders_val_split(tmp_path, tok_dir, model_cfg, tok):
    """train.eval_interval with data.name=energon evaluates on the prepared folder's val part."""
    from multimodal.evaluation import valid_data_config

    jsonl = _jsonl(tmp_path / "train.jsonl", write_synthetic_conversations(tmp_path, n=8))
    folder = write_energon_dataset(jsonl, tmp_path / "energon", samples_per_shard=2,
                                   split_parts=(("train", 0.5), ("val", 0.5)))
    d = _data("energon", folder, tok_dir)
    train = EnergonDataset(model_cfg, d, SEQ, tok)
    valid = EnergonDataset(model_cfg, valid_data_config(d), SEQ, tok)
    assert valid_data_config(d).energon.split_part == "val" and d.energon.split_part == "train"
    assert len(train) > 0 and len(valid) > 0 and len(train) + len(valid) == 8


def test_proxy_trains_on_an_energon_folder_and_resumes_bit_exact_mid_pass(tmp_path, tok_dir):
    """The trainer end to end: the proxy recipe on an energon folder, 4 steps with a checkpoint at
    step 2, then a fresh run from that checkpoint: steps 3-4 give the uninterrupted run's losses
    bit for bit, with the loader stopped inside its first pass over the set."""
    from multimodal.config import load_config
    from multimodal.training import train

    jsonl = _jsonl(tmp_path / "train.jsonl", write_synthetic_conversations(tmp_path, n=48))
    folder = write_energon_dataset(jsonl, tmp_path / "energon", samples_per_shard=10)
    common = ["data.name=energon", f"data.path={folder}", f"data.tokenizer={tok_dir}", "train.iters=4",
              "train.seq_length=256", "data.min_pixels=1024", "data.max_pixels=16384",
              "logging.progress_bar=false", "logging.tensorboard=false", "train.cuda_graphs=false"]
    full = train(load_config("configs/qwen35_vl_proxy_cord.yaml", [
        *common, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.interval=2", f"logging.dir={tmp_path / 'full'}"]))
    state = json.loads((tmp_path / "ck" / "iter_0000002" / "trainer_state.json").read_text())
    resumed = train(load_config("configs/qwen35_vl_proxy_cord.yaml", [
        *common, f"checkpoint.load={tmp_path / 'ck' / 'iter_0000002'}", f"checkpoint.dir={tmp_path / 'ck2'}",
        f"logging.dir={tmp_path / 'resumed'}"]))
    assert sorted(full.losses) == [1, 2, 3, 4] and sorted(resumed.losses) == [3, 4]
    assert all(resumed.losses[s] == full.losses[s] for s in (3, 4)), (full.losses, resumed.losses)
    assert 0 < state["data_next_max"] < 48, state  # the stop fell inside the first pass over the set
