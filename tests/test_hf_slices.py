"""Direct Hugging Face loading reads slices: under TP=2 and EP=2 each rank reads about its share of
the sharded tensors (counted by the reader, byte for byte), and what it loads is bit for bit what
reading every tensor whole gives (tests/helpers/mp_hf_slices.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from helpers.hf_fixtures import add_mtp_head, make_hf_checkpoint

# split by TP (column- or row-parallel, the vocabulary of the embedding and LM head) and by EP
TP_SPLIT = re.compile(r"(embed_tokens|lm_head|[qkvo]_proj|in_proj_(qkv|z|b|a)|out_proj|conv1d|A_log|dt_bias|"
                      r"(gate|up|down)_proj|gate_up_proj|mtp\.fc)\b")
EP_SPLIT = re.compile(r"\.experts\.")


def _fuse_experts(hf_dir: Path) -> None:
    """Rewrite a checkpoint's per-expert weights in transformers' fused layout (``experts.gate_up_proj``
    [E, 2F, H], ``experts.down_proj`` [E, H, F]), the layout a transformers save of its own can hold."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(hf_dir / "model.safetensors"))
    prefixes = sorted({n.split(".experts.")[0] for n in state if ".experts." in n})
    for p in prefixes:
        e = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in state if n.startswith(p + ".experts.")})
        take = lambda j, w: state.pop(f"{p}.experts.{j}.{w}.weight")  # noqa: E731
        state[f"{p}.experts.gate_up_proj"] = torch.stack([torch.cat([take(j, "gate_proj"), take(j, "up_proj")])
                                                         for j in e])
        state[f"{p}.experts.down_proj"] = torch.stack([take(j, "down_proj") for j in e])
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def test_each_rank_reads_its_slices_and_loads_the_whole_read_weights(tmp_path):
    """Per-expert files (the releases) and transformers' fused experts, one launch."""
    import shutil

    from test_hf import _run

    per_expert = make_hf_checkpoint(tmp_path / "per_expert", moe=True, layers=4, tied=False)
    add_mtp_head(per_expert)
    fused = Path(shutil.copytree(per_expert, tmp_path / "fused"))
    _fuse_experts(fused)
    report = tmp_path / "read.json"
    _run("tests/helpers/mp_hf_slices.py", str(report), str(per_expert), str(fused), "tp=2", "ep=2", nproc=2)
    reports = json.loads(report.read_text())
    assert sorted(reports) == sorted([str(per_expert), str(fused)])
    for folder, read in reports.items():
        single = read["single"]
        for layout, pattern in (("tp=2", TP_SPLIT), ("ep=2", EP_SPLIT)):
            split = [n for n in single if pattern.search(n)]
            assert len(split) >= 10, split
            for rank, mine in enumerate(read[layout]):
                where = f"{Path(folder).name} {layout} rank {rank}"
                assert all(mine.get(n, 0) <= single[n] for n in single), f"{where}: a tensor read twice"
                share = _by_weight({n: mine.get(n, 0) for n in split}), _by_weight({n: single[n] for n in split})
                over = {w: round(b / share[1][w], 2) for w, b in share[0].items() if b > 0.6 * share[1][w]}
                assert not over, f"{where} reads more than its share of {len(over)} weight(s): {over}"


def _by_weight(nbytes: dict[str, int]) -> dict[str, int]:
    """Bytes per weight, a layer's per-expert tensors counted as one weight (an EP rank reads whole
    tensors of its own experts and none of the others')."""
    out: dict[str, int] = {}
    for name, b in nbytes.items():
        key = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
        out[key] = out.get(key, 0) + b
    return out


def test_rows_touched_covers_every_element_a_view_reads_and_no_more_rows():
    """The rows and columns a strided view of a [N, width] matrix reads: the real views (a row range,
    a column range, an expert's gate half across experts, a 3-D row-parallel expert slice) get exactly
    their rows; a view that mixes rows and columns in one axis falls back to whole rows."""
    from multimodal.hf_convert import _rows_touched

    width = 8
    cases = [((3, 8), (8, 1), 16, False),           # rows 2..4 (column-parallel, vocabulary split)
             ((6, 4), (8, 1), 4, False),            # columns 4..7 of 6 rows (row-parallel)
             ((2, 3, 8), (48, 8, 1), 48, False),    # experts 1..2, gate half of each (6 rows per expert)
             ((2, 5, 4), (40, 8, 1), 44, False),    # experts 1..2 of [E, 5, 8], columns 4..7 (row-parallel fc2)
             ((4, 3), (12, 1), 5, True)]            # stride 12 is neither whole rows nor within a row
    for size, stride, offset, mixed in cases:
        touched = torch.arange(64 * width).as_strided(size, stride, offset).reshape(-1)
        rows, cols = set((touched // width).tolist()), (touched % width)
        runs, (c0, c1) = _rows_touched(size, stride, offset, width)
        read = {r for a, n in runs for r in range(a, a + n)}
        assert rows <= read and c0 <= int(cols.min()) and int(cols.max()) < c1, (size, stride, offset)
        assert (read == rows and c1 - c0 == int(cols.max()) - int(cols.min()) + 1) != mixed, (size, stride, offset)
