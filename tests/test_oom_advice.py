"""An out-of-memory step names the settings that would make the run fit (multimodal/observability/oom_advice.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from multimodal.config import load_config
from multimodal.observability.oom_advice import TrainingOutOfMemory, advice

ROOT = Path(__file__).resolve().parents[1]


def test_advice_lists_the_missing_recompute_modules_and_turns_the_graphs_off():
    cfg = load_config(ROOT / "configs/qwen35_vl_2b.yaml", ["train.seq_length=65536"])
    text = advice(cfg, 3)
    assert "out of GPU memory at step 3, train.seq_length=65536" in text
    assert "train.recompute_modules=[core_attn,gdn_norm_out,gdn_qkv,layernorm] train.cuda_graphs=false" in text
    assert "parallel.cp=2" in text and "parallel.use_distributed_optimizer=true" in text
    assert "this run has one: it needs more GPUs" in text
    assert "over the 4 data-parallel ranks" in advice(cfg, 3, data_parallel=4)


def test_advice_keeps_what_is_set_and_skips_gdn_blocks_under_context_parallelism():
    cfg = load_config(ROOT / "configs/qwen35_vl_proxy_moe.yaml",
                      ["train.recompute_modules=[core_attn]", "parallel.cp=2", "train.cuda_graphs=false"])
    text = advice(cfg, 1)
    # the MoE proxy has routed experts (moe_act) and shared experts; GDN recompute is not
    # implemented with cp > 1
    assert "train.recompute_modules=[core_attn,layernorm,moe_act,shared_experts]; it trades" in text
    assert "gdn_qkv" not in text and "cuda_graphs=false" not in text
    assert "parallel.cp=4" in text
    done = load_config(ROOT / "configs/qwen35_vl_proxy.yaml",
                       ["train.recompute_modules=[core_attn,gdn_norm_out,gdn_qkv,layernorm]"])
    assert "recompute_modules" not in advice(done, 1).split("Check a layout")[0]


def test_an_oom_inside_a_step_is_reraised_with_the_advice_and_the_original_chained(tmp_path):
    """The real entry point on the CPU proxy; the second micro-batch's forward (the proxy runs several per
    step: still step 1) raises the OOM."""
    script = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r})
from multimodal import forward_step
calls = [0]
real = forward_step.ForwardStep.__call__
def failing(self, *a, **k):
    calls[0] += 1
    if calls[0] == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB (simulated)")
    return real(self, *a, **k)
forward_step.ForwardStep.__call__ = failing
import pretrain_multimodal
pretrain_multimodal.main(["--config", "configs/qwen35_vl_proxy.yaml", "train.iters=3", "logging.dir={tmp_path}",
                          "logging.progress_bar=false", "logging.tensorboard=false", "checkpoint.dir=null"])
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    err = proc.stderr
    assert "Tried to allocate 1.50 GiB (simulated)" in err  # the original, chained
    assert "The above exception was the direct cause" in err
    tail = err[err.index("The above exception was the direct cause"):]
    assert "TrainingOutOfMemory: out of GPU memory at step 1, train.seq_length=512" in tail
    assert "train.recompute_modules=[" in tail
    assert issubclass(TrainingOutOfMemory, torch.OutOfMemoryError)  # callers catching OOM still do
