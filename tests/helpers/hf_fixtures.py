"""Tiny random transformers Qwen3.5 / Qwen3.5-MoE checkpoints, written by the tests themselves."""

from __future__ import annotations

from pathlib import Path

import torch


def make_hf_checkpoint(out: Path, moe: bool = False, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                       k_heads: int = 2, v_heads: int = 4, tied: bool = True, vision_depth: int = 2,
                       seed: int = 0, interval: int = 4) -> Path:
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)

    torch.manual_seed(seed)
    text = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=16, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=16, linear_value_head_dim=16, full_attention_interval=interval,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    vision = dict(depth=vision_depth, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64)
    ids = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    if moe:
        text.update(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                    num_experts_per_tok=2)
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied, **ids)
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        text.update(intermediate_size=96)
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tied, **ids)
        model = Qwen3_5ForConditionalGeneration(cfg)
    # random norms/gates so a zero-vs-one convention mix-up cannot hide
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return Path(out)


def add_mtp_head(hf_dir: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """Give a checkpoint written above the MTP head the released Qwen3.5 checkpoints carry (names as
    vLLM's Qwen3.5 MTP loader reads them): ``mtp.fc`` [H, 2H], the two pre-fc norms, one gated
    full-attention decoder layer ``mtp.layers.0.*`` (shaped as the model's own; MoE in MoE models)
    and ``mtp.norm``, random; ``mtp_num_hidden_layers: 1`` in config.json. Returns the new tensors."""
    import json

    from safetensors.torch import load_file, save_file

    hf_dir = Path(hf_dir)
    cfg = json.loads((hf_dir / "config.json").read_text())
    text = cfg["text_config"]
    full = text["layer_types"].index("full_attention")
    state = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    layer = f"model.language_model.layers.{full}."
    h = text["hidden_size"]
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * 0.02,
           "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=g) * 0.1,
           "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=g) * 0.1,
           "mtp.norm.weight": torch.randn(h, generator=g) * 0.1}
    for name, t in state.items():
        if name.startswith(layer):
            mtp["mtp.layers.0." + name[len(layer):]] = torch.randn(t.shape, generator=g).to(t.dtype) * t.float().std()
    state.update({k: v.to(next(iter(state.values())).dtype).contiguous() for k, v in mtp.items()})
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return mtp
