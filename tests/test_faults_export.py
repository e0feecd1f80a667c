"""An exported checkpoint run with transformers on a CPU of this environment: transformers takes
flash-linear-attention's Triton kernels whenever ``fla`` imports, and they fail without a GPU
("RuntimeError: 0 active drivers"); ``multimodal.platform.transformers_torch_kernels()`` is the
one line that makes it run (docs/fault_tolerance.md)."""

from __future__ import annotations

import importlib

import pytest
import torch

from helpers.hf_fixtures import make_hf_checkpoint


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU transformers' fla kernels work")
def test_a_hugging_face_checkpoint_runs_with_transformers_on_the_cpu(tmp_path):
    from transformers import AutoModelForImageTextToText

    from multimodal import platform

    hf = AutoModelForImageTextToText.from_pretrained(make_hf_checkpoint(tmp_path / "hf"))
    assert platform.transformers_torch_kernels() is True  # after loading works as well as before
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    assert not hasattr(mod.torch_chunk_gated_delta_rule, "__wrapped__")  # transformers' own function now
    logits = hf(input_ids=torch.randint(0, 500, (1, 24))).logits
    assert logits.shape == (1, 24, 512) and bool(torch.isfinite(logits).all())
