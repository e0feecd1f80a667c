"""docs/configuration.md's field table is generated from the config dataclasses (scripts/config_docs.py)."""

from __future__ import annotations

import dataclasses

from scripts.config_docs import COMMAND, PAGE, field_comments, page_text, render


def test_configuration_page_is_fresh():
    current = PAGE.read_text()
    assert page_text(current) == current, f"docs/configuration.md is stale: run {COMMAND}"


def test_every_section_and_key_is_in_the_table_with_its_default_and_comment():
    from data.config import DataConfig, VideoConfig
    from multimodal.config import Config, CudaGraphsConfig

    table = render()
    for f in dataclasses.fields(Config):
        assert f"### `{f.name}`" in table
    assert "| `data.video.fps` | `float` | `2.0` | frames a second sampled from a file;" in table
    assert "| `train.cuda_graphs.enabled` | `bool` | `false` |" in table
    # the comment at the end of a field's line wins over a block above it; a block above is used alone
    assert field_comments(VideoConfig)["max_frames"] == "frames kept per video, at most"
    assert field_comments(DataConfig)["valid_path"].startswith("validation data (read when train.eval_interval > 0")
    assert field_comments(CudaGraphsConfig)["max_samples"].startswith("samples per packed row")
    # a table cell never breaks the table: a '|' inside a comment is escaped
    assert "json (gt_parse as JSON, key order kept) \\| donut (tags)" in table


def test_a_stale_page_is_reported_and_rewritten(tmp_path, monkeypatch):
    import scripts.config_docs as config_docs

    page = tmp_path / "configuration.md"
    page.write_text("# Configuration\n\nHand-written intro.\n\n" + config_docs.MARKER + "\n\nold table\n")
    monkeypatch.setattr(config_docs, "PAGE", page)
    assert config_docs.main(["--check"]) == 1
    assert config_docs.main([]) == 0
    text = page.read_text()
    assert text.startswith("# Configuration\n\nHand-written intro.\n\n" + config_docs.MARKER)
    assert "old table" not in text and config_docs.main(["--check"]) == 0
