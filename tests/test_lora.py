"""model.lora: step 0 is the base model bit for bit; only the adapters train (base weights
bit-identical, optimizer state for adapters only) and the loss falls; a base-only checkpoint
loads under LoRA; --merge-lora exports HF weights whose logits equal the LoRA model's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers.hf_fixtures import make_hf_checkpoint
from helpers.proxy_fixtures import optimizer_steps
from test_hf import _run_in_one_process

from models.common.lora import is_adapter_param
from multimodal.config import ConfigError, load_config, validate

PROXY = "configs/qwen35_vl_proxy.yaml"
MOE = "configs/qwen35_vl_proxy_moe.yaml"
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


def _build(mcore, config: str, overrides: list[str], seed: int = 0):
    from core.seeding import seed_everything
    from multimodal.training import build_model_and_optimizer

    cfg = load_config(config, [*overrides, "optimizer.lr=1e-2", "optimizer.warmup_iters=0"])
    validate(cfg)
    seed_everything(seed)
    return cfg, *build_model_and_optimizer(cfg, mcore, torch.float32)


def _train(mcore, config: str, overrides: list[str], steps: int):
    """(model, optimizer, weights before, weights after, per-step losses)."""
    cfg, model, ddp, optimizer, scheduler = _build(mcore, config, overrides)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = optimizer_steps(cfg, model, ddp, optimizer, scheduler, steps)
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, optimizer, before, after, losses


@pytest.mark.parametrize("config", [PROXY, MOE])
def test_step0_is_the_base_model_and_only_adapters_train(mcore, config):
    *_, base_losses = _train(mcore, config, [], steps=1)
    model, optimizer, before, after, losses = _train(mcore, config, LORA, steps=3)
    assert torch.equal(losses[0], base_losses[0])  # B = 0: bit for bit
    adapters = [n for n in before if is_adapter_param(n)]
    base = [n for n in before if not is_adapter_param(n)]
    # every target present in the proxy got an adapter (MoE: attention, GDN and shared expert)
    kinds = {n.split(".")[-2] for n in adapters}
    assert {"linear_qkv", "linear_proj", "in_proj", "out_proj", "linear_fc1", "linear_fc2"} <= kinds
    if config == MOE:
        assert any(".shared_experts." in n for n in adapters)
        assert not any(".experts." in n and ".shared_experts." not in n for n in adapters)
    for n in base:
        assert torch.equal(before[n], after[n]), n
    assert all(not torch.equal(before[n], after[n]) for n in adapters if n.endswith("lora_B"))
    params = dict(model.named_parameters())
    assert all(getattr(params[n], "main_grad", None) is None for n in base)
    inner = optimizer.optimizer
    optimized = {id(p) for g in inner.param_groups for p in g["params"]}
    assert optimized == {id(params[n]) for n in adapters}
    adapter_numel = sum(params[n].numel() for n in adapters)
    state_numel = sum(t.numel() for st in inner.state.values() for t in st.values() if torch.is_tensor(t) and t.dim())
    assert state_numel == 2 * adapter_numel  # Adam's m and v, adapters only


def test_lora_lowers_the_loss(mcore):
    *_, losses = _train(mcore, PROXY, LORA, steps=8)
    assert losses[-1] < 0.9 * losses[0], [x.item() for x in losses]


def test_lora_checkpoint_resumes(mcore, tmp_path):
    """Adapters and their optimizer state are in the sharded checkpoint: a resumed run (built
    with another seed, so other initial A) repeats the uninterrupted losses."""
    from multimodal import checkpointing

    cfg, *run = _build(mcore, PROXY, LORA)
    whole = optimizer_steps(cfg, *run, steps=4)
    cfg, *run = _build(mcore, PROXY, LORA)
    first = optimizer_steps(cfg, *run, steps=2)
    model, ddp, optimizer, scheduler = run
    assert any(is_adapter_param(k) for k in model.sharded_state_dict())
    checkpointing.save(str(tmp_path), 2, model, optimizer, scheduler, {})
    cfg, *run = _build(mcore, PROXY, LORA, seed=1)
    model, ddp, optimizer, scheduler = run
    assert checkpointing.load(checkpointing.resolve("latest", str(tmp_path)), model, optimizer, scheduler)[0] == 2
    rest = optimizer_steps(cfg, *run, steps=2)
    assert torch.equal(torch.stack(first + rest), torch.stack(whole))


def test_lora_requests_are_checked():
    def refused(overrides, needle):
        cfg = load_config(PROXY, overrides)
        with pytest.raises(ConfigError, match=needle):
            validate(cfg)

    refused([*LORA, "model.lora.targets=[experts]"], r"model\.lora\.targets: routed experts")
    refused([*LORA, "model.lora.targets=[qkv]"], r"model\.lora\.targets: unknown")
    refused([*LORA, "model.lora.dropout=1.0"], r"model\.lora\.dropout")
    refused([*LORA, "model.lora.alpha=0"], r"model\.lora\.alpha")
    refused(["model.lora.rank=-1"], r"model\.lora\.rank")
    validate(load_config(PROXY, [*LORA, "parallel.tp=2", "parallel.sequence_parallel=true"]), world_size=2)


def test_merged_export_matches_the_lora_model(mcore, tmp_path):
    """A base-only checkpoint (imported from HF) loads under LoRA with fresh adapters; with the
    adapters set, the --merge-lora export's logits in transformers equal ours (fp32)."""
    from transformers import AutoModelForImageTextToText

    from models.qwen35_vl.hf import model_config_from_hf
    from models.qwen35_vl.model import build
    from models.qwen35_vl.mrope import mrope_position_ids
    from models.qwen35_vl.parity import parity_inputs, use_hf_torch_kernels
    from multimodal import checkpointing
    from models.common.parallel_config import ParallelConfig
    from models.qwen35_vl.config import LoRAConfig
    from multimodal.lora import apply_lora
    from core.seeding import seed_everything

    from scripts import convert_hf

    hf_dir = make_hf_checkpoint(tmp_path / "hf", moe=True, tied=False)  # shared expert + GDN + attention
    convert_hf.do_import(str(hf_dir), str(tmp_path / "imported"), 1, 1, 1)  # in this process, as test_hf_streaming
    m = model_config_from_hf(hf_dir)
    m.attention_backend, m.gdn_backend, m.moe_aux_loss_coeff = "sdpa", "torch", 0.0
    m.lora = LoRAConfig(rank=4, alpha=8.0)
    seed_everything(0)
    model = build(m, ParallelConfig(), torch.float32)
    apply_lora(model, m.lora)
    checkpointing.load_weights(checkpointing.resolve(str(tmp_path / "imported"), None), model)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter_param(n)}
    assert adapters and all(not p.any() for n, p in adapters.items() if n.endswith("lora_B"))  # fresh
    with torch.no_grad():
        for n, p in adapters.items():
            if n.endswith("lora_B"):
                p.normal_(std=0.05)
    model.eval()
    input_ids, pixels, grid, _ = parity_inputs(m, seed=0)
    pos = mrope_position_ids(input_ids[0], grid, m.image_token_id, m.vision.spatial_merge_size)[:, None]
    with torch.no_grad():
        ours = model(input_ids, pos, pixel_values=pixels, image_grid_thw=grid)
    checkpointing.save_weights(tmp_path / "lora", model, meta_files={
        "model_config.json": json.dumps(dataclasses.asdict(m)), "hf_config.json": (hf_dir / "config.json").read_text()})

    # the three exports of this checkpoint in one process, each as its own CLI run
    proc_out = tmp_path / "merged"
    refused, merged, adapter_only = _run_in_one_process(
        ("scripts/convert_hf.py", "export", "--ckpt", str(tmp_path / "lora"), "--out", str(tmp_path / "x")),
        ("scripts/convert_hf.py", "export", "--ckpt", str(tmp_path / "lora"), "--out", str(proc_out),
         "--dtype", "fp32", "--merge-lora"),
        ("scripts/convert_hf.py", "export", "--ckpt", str(tmp_path / "lora"), "--out", str(tmp_path / "peft"),
         "--adapter-only"))
    assert refused[0] != 0 and "pass --merge-lora" in refused[2], refused
    assert merged[0] == 0, merged[2][-4000:]
    assert adapter_only[0] == 0, adapter_only[2][-4000:]
    use_hf_torch_kernels()
    hf = AutoModelForImageTextToText.from_pretrained(proc_out, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        theirs = hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid,
                    mm_token_type_ids=(input_ids == m.image_token_id).int()).logits
    base = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        base_logits = base(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid,
                           mm_token_type_ids=(input_ids == m.image_token_id).int()).logits
    assert (base_logits - ours).abs().max() > 1e-2  # the adapters matter
    assert (theirs - ours).abs().max() <= 1e-4

    # --adapter-only: a PEFT adapter that peft loads on top of the base HF checkpoint
    from peft import PeftModel  # in the dev extra: a missing peft fails this test, never skips the check
    peft_model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        peft_logits = peft_model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grid,
                                 mm_token_type_ids=(input_ids == m.image_token_id).int()).logits
    assert (peft_logits - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("config", [PROXY, MOE])
def test_dry_run_counts_the_adapters_exactly(mcore, config):
    from models.qwen35_vl.model import build
    from models.common.parallel_config import ParallelConfig
    from multimodal.dry_run import check_layout, stage_memory, stage_params
    from multimodal.lora import apply_lora
    from core.seeding import seed_everything

    cfg = load_config(config, LORA)
    validate(cfg)
    seed_everything(0)
    model = build(cfg.model, ParallelConfig(), torch.float32)
    apply_lora(model, cfg.model.lora)
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_param(n))
    base = sum(p.numel() for n, p in model.named_parameters() if not is_adapter_param(n))
    lay, _ = check_layout(cfg, 1)
    sp = stage_params(cfg.model, lay.tp, lay.pp, lay.ep, 0)
    assert sp.parts["lora"] == adapters
    assert sp.total - sp.frozen == adapters and sp.frozen == base
    mem = stage_memory(cfg, lay, sp)
    assert mem.grads == pytest.approx(4 * adapters / 2**30)  # fp32 gradient for the adapters only
