"""Fault injection in the recipe: malformed YAML names file:line:column in one line; the learning
rates are checked in both directions; the entry point exits with code 2 and no traceback."""

from __future__ import annotations

import pytest

from helpers.fault_helpers import run_cli
from multimodal.config import ConfigError, load_config, validate

PROXY = "configs/qwen35_vl_proxy.yaml"


def test_malformed_yaml_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name: qwen35_vl\ntrain:\n  iters: [1, 2\n  seed: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert msg.startswith(f"{bad}:5:") and "invalid YAML" in msg and "\n" not in msg, msg


def test_malformed_override_is_named():
    with pytest.raises(ConfigError, match=r"^override 'train.iters=\[1':1:3: invalid YAML: expected ',' or ']'"):
        load_config(PROXY, ["train.iters=[1"])


@pytest.mark.parametrize("overrides, needle", [
    (["optimizer.lr=-1"], r"optimizer.lr must be >= 0, got -1"),
    (["optimizer.lr=-1", "optimizer.min_lr=-2"], r"optimizer.lr must be >= 0, got -1"),
    (["optimizer.lr=0", "optimizer.min_lr=1e-5"], r"optimizer.min_lr \(1e-05\) must be <= optimizer.lr \(0.0\)"),
    (["optimizer.min_lr=-1e-5"], r"optimizer.min_lr must be >= 0"),
    (["optimizer.lr=1e-4", "optimizer.min_lr=1e-3"], r"optimizer.min_lr \(0.001\) must be <= optimizer.lr \(0.0001\)"),
    (["train.on_nonfinite=ignore"], r"train.on_nonfinite must be skip\|stop"),
    (["train.max_nonfinite_steps=0"], r"train.max_nonfinite_steps must be >= 1"),
    (["logging.wandb_mode=sometimes"], r"logging.wandb_mode must be"),
    (["model.attention_backend=flash"], r"model.attention_backend must be one of auto\|sdpa\|varlen\|cudnn, got 'flash'"),
    (["model.gdn_backend=flashqla"], r"model.gdn_backend must be one of auto\|flash_qla\|fla\|torch, got 'flashqla'"),
])
def test_learning_rates_guard_settings_and_kernel_backends_are_checked(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(load_config(PROXY, overrides))


def test_cli_prints_one_line_and_exits_2_for_bad_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  iters: 3\n   seed: 1\n")
    run = run_cli(tmp_path, config=str(bad), tiny=False)
    assert run.rc == 2
    assert run.last_line.startswith(f"error: {bad}:3:") and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_a_video_id_left_at_the_synthetic_default_is_refused():
    """With a real vocabulary the synthetic default 1007 is an ordinary text token: counted as a
    video placeholder it breaks every sample that contains it, so the recipe check names it.
    Every released-size recipe sets the tokenizer's id."""
    with pytest.raises(ConfigError, match=r"model.video_token_id=1007 is far from model.image_token_id=248056"):
        validate(load_config("configs/qwen35_vl_2b.yaml", ["model.video_token_id=1007"]))
    for recipe in ("2b", "2b_sft", "9b", "35b_a3b", "397b_a17b"):
        assert load_config(f"configs/qwen35_vl_{recipe}.yaml").model.video_token_id == 248057


def test_a_gdn_backend_that_cannot_run_here_is_one_line_with_the_fix(tmp_path):
    """model.gdn_backend=flash_qla where FlashQLA cannot run (here: no CUDA device) is refused while
    the model is built, in one line that names the setting and the fix, exit code 2."""
    run = run_cli(tmp_path, "model.gdn_backend=flash_qla")
    assert run.rc == 2, run.stderr[-2000:]
    assert run.last_line.startswith("error: model.gdn_backend=flash_qla cannot run: ") and "Traceback" not in run.stderr
    assert "model.gdn_backend=auto" in run.last_line
