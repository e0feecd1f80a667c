"""Fault injection in the data: rows that cannot become samples (text that is not UTF-8, cells of
the wrong type, anything else that fails) are skipped and counted by reason, never fatal; files
with the wrong columns stop the run with one line naming the file and the missing columns."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from data.cord_v2 import CordV2Dataset
from data.loader import MicroBatchIterator
from helpers.fault_helpers import run_cli
from models.qwen35_vl.config import ModelConfig
from multimodal.config import DataConfig
from core.errors import DataError


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(a synthetic CORD folder, its tokenizer dir, one good row as a dict)."""
    from data.synthetic_cord import write_synthetic_cord
    from data.tiny_tokenizer import build_tiny_tokenizer

    root = tmp_path_factory.mktemp("cord")
    write_synthetic_cord(root / "data", n_train=4, n_val=1, n_test=1, seed=5)
    build_tiny_tokenizer(root / "tok")
    import pyarrow.parquet as pq

    good = pq.read_table(sorted((root / "data").glob("train-*.parquet"))[0]).to_pylist()[0]
    return root, good


def _dataset(folder: Path, tok_dir: Path) -> CordV2Dataset:
    from data.chat import special_token_ids
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model = ModelConfig(vocab_size=512, **special_token_ids(tok))
    return CordV2Dataset(model, dataclasses.replace(DataConfig(), name="cord_v2", path=str(folder)), 1024, tok)


def _write(folder: Path, image, ground_truth) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"image": image, "ground_truth": ground_truth}), folder / "train-00000-of-00001.parquet")
    return folder


def test_undecodable_text_and_wrong_types_are_skipped_by_reason(tmp_path, made):
    import pyarrow as pa

    root, good = made
    image = pa.array([good["image"]] * 3)
    text = good["ground_truth"].encode()
    # a string column holding bytes that are not UTF-8 (pyarrow reads it; as_py raised before)
    invalid_string = pa.array([text, b"\xff\xfe{", text], pa.binary()).view(pa.string())
    ds = _dataset(_write(tmp_path / "a", image, invalid_string), root / "tok")
    got = [ds[i] for i in range(3)]
    assert got[0] is not None and got[1] is None and got[2] is not None
    assert dict(ds.skipped) == {"bad_text": 1}

    # a binary ground_truth column: valid UTF-8 is used (it was reported "missing"), invalid skipped
    ds = _dataset(_write(tmp_path / "b", image, pa.array([text, b"\xc3\x28", text], pa.binary())), root / "tok")
    assert [ds[i] is None for i in range(3)] == [False, True, False] and dict(ds.skipped) == {"bad_text": 1}

    # wrong column types: every row skipped as wrong_type, none raises
    ds = _dataset(_write(tmp_path / "c", image, pa.array([1, 2, 3])), root / "tok")
    assert all(ds[i] is None for i in range(3)) and dict(ds.skipped) == {"wrong_type": 3}
    ds = _dataset(_write(tmp_path / "d", pa.array(["x", "y", "z"]), pa.array([good["ground_truth"]] * 3)),
                  root / "tok")
    assert all(ds[i] is None for i in range(3)) and dict(ds.skipped) == {"wrong_type": 3}


def test_any_other_row_failure_is_skipped_and_the_loader_summarises(tmp_path, made, monkeypatch):
    root, good = made
    import pyarrow as pa

    ds = _dataset(_write(tmp_path / "a", pa.array([good["image"]] * 4), pa.array([good["ground_truth"]] * 4)),
                  root / "tok")
    real = ds._image

    def flaky(cell):  # a failure nobody anticipated, in row 1 only
        if flaky.calls == 1:
            flaky.calls += 1
            raise ZeroDivisionError("surprise")
        flaky.calls += 1
        return real(cell)
    flaky.calls = 0
    monkeypatch.setattr(ds, "_image", flaky)
    loader = MicroBatchIterator(ds, 1024, 0, ds.ids["image_token_id"], 2, True, 1, 0, 1, max_bad_fraction=0.5)
    next(loader)
    summary = loader.summary()
    assert summary["rows_skipped"] == 1 and summary["skipped_by_reason"] == {"error_ZeroDivisionError": 1}
    assert summary["rows_read"] >= 2


def test_parquet_without_a_column_names_the_file_and_the_columns(tmp_path, made):
    import pyarrow as pa

    root, good = made
    folder = tmp_path / "bad"
    folder.mkdir()
    pa_table = pa.table({"image": pa.array([good["image"]]), "label": pa.array(["x"])})
    import pyarrow.parquet as pq

    pq.write_table(pa_table, folder / "train-00000-of-00001.parquet")
    with pytest.raises(DataError) as e:
        _dataset(folder, root / "tok")
    assert str(e.value).startswith(f"{folder}/train-00000-of-00001.parquet: missing column(s) ground_truth "
                                   "(found: image, label)")


@pytest.mark.slow
def test_cli_schema_error_is_one_line_with_exit_code_2(tmp_path, made):
    root, good = made
    folder = tmp_path / "data"
    shutil.copytree(root / "data", folder)
    victim = sorted(folder.glob("train-*.parquet"))[-1]
    victim.write_bytes(b"PAR1 this is not parquet")
    run = run_cli(tmp_path, "train.iters=1", f"data.path={folder}", f"data.tokenizer={root / 'tok'}",
                  "checkpoint.dir=null", config="configs/qwen35_vl_proxy_cord.yaml")
    assert run.rc == 2, run.stderr[-3000:]
    assert run.last_line.startswith(f"error: {victim}: not a readable parquet file"), run.last_line


def test_a_non_utf8_line_in_a_conversations_jsonl_is_skipped_and_counted(tmp_path, made, capsys):
    """In training (the dataset's skip count) and in multimodal.inspect_data, which printed a
    UnicodeDecodeError traceback before."""
    import json

    from multimodal.inspect_data import main as inspect_main

    root, _ = made[0], made[1]
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(good).encode() + b"\n" + b'{"messages": "caf\xe9"}\n' + json.dumps(good).encode() + b"\n")
    rc = inspect_main(["--config", "configs/qwen35_vl_proxy_cord.yaml", "--num", "2", "--json",
                       "data.name=conversations", f"data.path={path}", f"data.tokenizer={root / 'tok'}"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 2]  # record 1 skipped, not a crash

    from data.conversations import ConversationsDataset
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    from data.chat import special_token_ids

    ds = ConversationsDataset(ModelConfig(vocab_size=512, **special_token_ids(tok)),
                              DataConfig(name="conversations", path=str(path)), 256, tok)
    assert ds[1] is None and ds[0] is not None and dict(ds.skipped) == {"bad_text": 1}


def test_cord_data_path_that_does_not_exist_is_refused_before_the_model_is_built(tmp_path, made, capsys):
    from pretrain_multimodal import main

    rc = main(["--config", "configs/qwen35_vl_proxy_cord.yaml", f"data.path={tmp_path / 'no_such'}",
               f"data.tokenizer={made[0] / 'tok'}", f"logging.dir={tmp_path / 'log'}"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: data.path='{tmp_path / 'no_such'}' does not exist (data.name=cord_v2 reads a folder "
                       "of parquet files, e.g. scripts/make_synthetic_cord.py's output); point data.path at it"), err
    assert not (tmp_path / "log").exists()  # refused before any run


@pytest.mark.parametrize("body, problem", [(b'[{"messages": "caf\xe9"}]', "is not UTF-8 (byte 0xe9 at offset 18)"),
                                           (b'[{"messages": ', "is not valid JSON")])
def test_a_json_list_file_that_cannot_be_read_is_one_line_naming_the_file(tmp_path, made, capsys, body, problem):
    """A .json list is parsed whole, so a bad byte cannot be skipped as a row: the file is refused in
    one line (inspect_data printed a UnicodeDecodeError traceback before)."""
    from multimodal.inspect_data import main as inspect_main

    path = tmp_path / "d.json"
    path.write_bytes(body)
    rc = inspect_main(["--config", "configs/qwen35_vl_proxy_cord.yaml", "--num", "1",
                       "data.name=conversations", f"data.path={path}", f"data.tokenizer={made[0] / 'tok'}"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: data.path='{path}': {path} {problem}"), err
    assert "JSONL" in err[-1]
