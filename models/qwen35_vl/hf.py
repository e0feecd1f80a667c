"""Hugging Face Qwen3.5 / Qwen3.5-MoE <-> our model: config and weights.

Weights are mapped between a transformers checkpoint state dict (the on-disk names of
``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``) and the *full*
(unsharded, TP=1) state dict of ``models.base.MultimodalModel``. Sharding for TP/EP is
megatron's job (dist-checkpointing), so conversion never needs to know the layout.

Fused / split tensors:
- GDN ``in_proj`` = rows [q | k | v | z | beta | alpha] = in_proj_qkv ++ in_proj_z ++
  in_proj_b ++ in_proj_a (megatron's layout per TP rank; at TP=1 exactly this order).
- attention ``linear_qkv``: per query group g, [q heads of g | gate heads of g | k_g | v_g];
  HF's ``q_proj`` holds, per head, [q_h | gate_h].
- MLP / experts ``linear_fc1`` = [gate_proj | up_proj] (megatron's GLU applies the
  activation to the first half); the routed experts of a layer are stacked on a leading expert
  axis (``experts.linear_fc1.weight`` [E, 2F, H], ``experts.linear_fc2.weight`` [E, H, F]).
- vision ``patch_embed``: a linear layer on the flat (C, t, p, p) patch = HF's Conv3d weight
  reshaped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.qwen35_vl.config import ModelConfig, VisionConfig

HF_PREFIX = "model.language_model."
HF_VISION = "model.visual."


# ---------------------------------------------------------------- config


def model_config_from_hf(hf_dir: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """Our ``model`` section from a checkpoint's config.json (shapes are never hand-written)."""
    path = Path(hf_dir)
    raw = json.loads((path if path.is_file() else path / "config.json").read_text())
    t, v = raw.get("text_config", raw), raw.get("vision_config", {})
    rope = t.get("rope_parameters") or {}
    types = t.get("layer_types")
    interval = int(t.get("full_attention_interval", 4))
    if types:
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        interval = full[0] + 1 if full else len(types) + 1
        expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]
        if types != expected:
            raise ValueError(f"{hf_dir}: layer_types {types} is not a regular every-{interval} pattern")
    cfg = base or ModelConfig()
    m = {
        **cfg.__dict__,
        "hidden_size": t["hidden_size"],
        "num_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"],
        "num_query_groups": t["num_key_value_heads"],
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "ffn_hidden_size": t.get("intermediate_size") or cfg.ffn_hidden_size,
        "vocab_size": t["vocab_size"],
        "max_position_embeddings": t.get("max_position_embeddings", cfg.max_position_embeddings),
        "full_attention_interval": interval,
        "linear_num_key_heads": t["linear_num_key_heads"],
        "linear_num_value_heads": t["linear_num_value_heads"],
        "linear_key_head_dim": t["linear_key_head_dim"],
        "linear_value_head_dim": t["linear_value_head_dim"],
        "linear_conv_kernel_dim": t.get("linear_conv_kernel_dim", 4),
        "partial_rotary_factor": rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25)),
        "rope_theta": rope.get("rope_theta", t.get("rope_theta", cfg.rope_theta)),
        "mrope_section": list(rope.get("mrope_section", cfg.mrope_section)),
        "mrope_interleaved": bool(rope.get("mrope_interleaved", True)),
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
        "num_experts": t.get("num_experts", 0) or 0,
        "image_token_id": raw.get("image_token_id", cfg.image_token_id),
        "vision_start_token_id": raw.get("vision_start_token_id", cfg.vision_start_token_id),
        "vision_end_token_id": raw.get("vision_end_token_id", cfg.vision_end_token_id),
        "video_token_id": raw.get("video_token_id", cfg.video_token_id),
        "hf_config": str(hf_dir),
    }
    for ours, key in (("eos_token_id", "eos_token_id"), ("pad_token_id", "pad_token_id")):
        value = t.get(key, raw.get(key))
        if isinstance(value, list):
            value = value[0]
        if isinstance(value, int):
            m[ours] = value
    if m["num_experts"]:
        m["moe_router_topk"] = t["num_experts_per_tok"]
        m["moe_ffn_hidden_size"] = t["moe_intermediate_size"]
        m["moe_shared_expert_intermediate_size"] = t.get("shared_expert_intermediate_size", 0) or 0
        m["moe_aux_loss_coeff"] = t.get("router_aux_loss_coef", cfg.moe_aux_loss_coeff)
    vrope = v.get("rope_parameters") or {}
    m["vision"] = VisionConfig(
        depth=v.get("depth", cfg.vision.depth),
        hidden_size=v.get("hidden_size", cfg.vision.hidden_size),
        intermediate_size=v.get("intermediate_size", cfg.vision.intermediate_size),
        num_heads=v.get("num_heads", cfg.vision.num_heads),
        in_channels=v.get("in_channels", 3),
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        num_position_embeddings=v.get("num_position_embeddings", cfg.vision.num_position_embeddings),
        rope_theta=vrope.get("rope_theta", 10000.0),
    )
    if v and v.get("out_hidden_size", m["hidden_size"]) != m["hidden_size"]:
        raise ValueError(f"{hf_dir}: vision out_hidden_size {v['out_hidden_size']} != hidden_size {m['hidden_size']}")
    return ModelConfig(**m)


# ---------------------------------------------------------------- weights


def _attn_qkv_from_hf(q_proj, k_proj, v_proj, m: ModelConfig) -> torch.Tensor:
    hd, nq, ng = m.head_dim, m.num_attention_heads, m.num_query_groups
    per = nq // ng
    q_gate = q_proj.view(nq, 2, hd, -1)  # per head: [q_h, gate_h]
    k, v = k_proj.view(ng, hd, -1), v_proj.view(ng, hd, -1)
    rows = []
    for g in range(ng):
        heads = q_gate[g * per : (g + 1) * per]
        rows += [heads[:, 0].reshape(per * hd, -1), heads[:, 1].reshape(per * hd, -1), k[g], v[g]]
    return torch.cat(rows)


def _attn_qkv_to_hf(qkv, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hd, nq, ng = m.head_dim, m.num_attention_heads, m.num_query_groups
    per = nq // ng
    groups = qkv.view(ng, (2 * per + 2) * hd, -1)
    q = groups[:, : per * hd].reshape(nq, hd, -1)
    gate = groups[:, per * hd : 2 * per * hd].reshape(nq, hd, -1)
    k = groups[:, 2 * per * hd : (2 * per + 1) * hd].reshape(ng * hd, -1)
    v = groups[:, (2 * per + 1) * hd :].reshape(ng * hd, -1)
    return torch.stack([q, gate], 1).reshape(nq * 2 * hd, -1), k, v


def _gdn_sizes(m: ModelConfig) -> list[int]:
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    vd = m.linear_num_value_heads * m.linear_value_head_dim
    return [2 * qk + vd, vd, m.linear_num_value_heads, m.linear_num_value_heads]


def _vision_pairs(m: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) for vision tensors copied as they are (patch_embed is reshaped)."""
    pairs = [("pos_embed.weight", "pos_embed.weight"), ("patch_embed.bias", "patch_embed.proj.bias")]
    for i in range(m.vision.depth):
        for ours, hf in [("norm1", "norm1"), ("norm2", "norm2"), ("qkv", "attn.qkv"), ("proj", "attn.proj"),
                         ("fc1", "mlp.linear_fc1"), ("fc2", "mlp.linear_fc2")]:
            for p in ("weight", "bias"):
                pairs.append((f"blocks.{i}.{ours}.{p}", f"blocks.{i}.{hf}.{p}"))
    for ours, hf in [("merger_norm", "merger.norm"), ("merger_fc1", "merger.linear_fc1"),
                     ("merger_fc2", "merger.linear_fc2")]:
        for p in ("weight", "bias"):
            pairs.append((f"{ours}.{p}", f"{hf}.{p}"))
    return pairs


def _mlp_pairs(prefix_ours: str, prefix_hf: str, m: ModelConfig) -> list[tuple[str, list[str]]]:
    """(our fc1/fc2 name, HF names) for the dense MLP, the router and the shared expert (the routed
    experts are stacked: ``_expert_names``)."""
    glu = lambda o, h: [(f"{o}.linear_fc1.weight", [f"{h}.gate_proj.weight", f"{h}.up_proj.weight"]),  # noqa: E731
                        (f"{o}.linear_fc2.weight", [f"{h}.down_proj.weight"])]
    if not m.num_experts:
        return glu(prefix_ours, prefix_hf)
    out = [(f"{prefix_ours}.router.weight", [f"{prefix_hf}.gate.weight"])]
    if m.moe_shared_expert_intermediate_size:
        out += glu(f"{prefix_ours}.shared_experts", f"{prefix_hf}.shared_expert")
        out.append((f"{prefix_ours}.shared_experts.gate_weight", [f"{prefix_hf}.shared_expert_gate.weight"]))
    return out


def _expert_names(i: int) -> tuple[str, str, str]:
    """Our stacked expert weights of layer i (fc1 [E, 2F, H], fc2 [E, H, F]) and the HF prefix
    of its per-expert tensors (``<prefix>.<e>.gate_proj.weight`` ...)."""
    o = f"language_model.decoder.layers.{i}.mlp.experts"
    return f"{o}.linear_fc1.weight", f"{o}.linear_fc2.weight", f"{HF_PREFIX}layers.{i}.mlp.experts"


def _layer_pairs(m: ModelConfig, i: int) -> list[tuple[str, list[str]]]:
    """(our name, HF names concatenated on dim 0) for layer i, except the attention qkv."""
    o, h = f"language_model.decoder.layers.{i}", f"{HF_PREFIX}layers.{i}"
    pairs = [(f"{o}.input_layernorm.weight", [f"{h}.input_layernorm.weight"]),
             (f"{o}.pre_mlp_layernorm.weight", [f"{h}.post_attention_layernorm.weight"])]
    if m.is_full_attention(i):
        a = f"{h}.self_attn"
        pairs += [(f"{o}.self_attention.q_layernorm.weight", [f"{a}.q_norm.weight"]),
                  (f"{o}.self_attention.k_layernorm.weight", [f"{a}.k_norm.weight"]),
                  (f"{o}.self_attention.linear_proj.weight", [f"{a}.o_proj.weight"])]
    else:
        a = f"{h}.linear_attn"
        pairs += [(f"{o}.self_attention.in_proj.weight",
                   [f"{a}.in_proj_qkv.weight", f"{a}.in_proj_z.weight", f"{a}.in_proj_b.weight",
                    f"{a}.in_proj_a.weight"]),
                  (f"{o}.self_attention.conv1d.weight", [f"{a}.conv1d.weight"]),
                  (f"{o}.self_attention.A_log", [f"{a}.A_log"]),
                  (f"{o}.self_attention.dt_bias", [f"{a}.dt_bias"]),
                  (f"{o}.self_attention.out_norm.weight", [f"{a}.norm.weight"]),
                  (f"{o}.self_attention.out_proj.weight", [f"{a}.out_proj.weight"])]
    return pairs + _mlp_pairs(f"{o}.mlp", f"{h}.mlp", m)


def hf_to_ours(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (TP=1) state dict of our model from an HF state dict. Raises on missing tensors."""
    out: dict[str, torch.Tensor] = {}

    def get(name):
        try:
            return hf[name]
        except KeyError:
            raise KeyError(f"HF checkpoint lacks {name}") from None

    out["language_model.embedding.word_embeddings.weight"] = get(f"{HF_PREFIX}embed_tokens.weight")
    out["language_model.decoder.final_layernorm.weight"] = get(f"{HF_PREFIX}norm.weight")
    if not m.tie_word_embeddings:
        out["language_model.output_layer.weight"] = get("lm_head.weight")
    for i in range(m.num_layers):
        for ours, names in _layer_pairs(m, i):
            out[ours] = torch.cat([get(n) for n in names]) if len(names) > 1 else get(names[0])
        if m.num_experts:
            fc1, fc2, e = _expert_names(i)
            experts = range(m.num_experts)
            out[fc1] = torch.stack([torch.cat([get(f"{e}.{j}.gate_proj.weight"), get(f"{e}.{j}.up_proj.weight")])
                                    for j in experts])
            out[fc2] = torch.stack([get(f"{e}.{j}.down_proj.weight") for j in experts])
        if m.is_full_attention(i):
            a = f"{HF_PREFIX}layers.{i}.self_attn"
            out[f"language_model.decoder.layers.{i}.self_attention.linear_qkv.weight"] = _attn_qkv_from_hf(
                get(f"{a}.q_proj.weight"), get(f"{a}.k_proj.weight"), get(f"{a}.v_proj.weight"), m)
    for ours, hf_name in _vision_pairs(m):
        out[f"vision_model.{ours}"] = get(HF_VISION + hf_name)
    w = get(HF_VISION + "patch_embed.proj.weight")
    out["vision_model.patch_embed.weight"] = w.reshape(w.shape[0], -1)
    return out


def ours_to_hf(ours: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk names) from our full (TP=1) state dict; inverse of hf_to_ours."""
    hf: dict[str, torch.Tensor] = {}
    hf[f"{HF_PREFIX}embed_tokens.weight"] = ours["language_model.embedding.word_embeddings.weight"]
    hf[f"{HF_PREFIX}norm.weight"] = ours["language_model.decoder.final_layernorm.weight"]
    if not m.tie_word_embeddings:
        hf["lm_head.weight"] = ours["language_model.output_layer.weight"]
    for i in range(m.num_layers):
        for name, names in _layer_pairs(m, i):
            t = ours[name]
            if len(names) == 1:
                hf[names[0]] = t
            elif name.endswith("in_proj.weight"):
                hf.update(zip(names, torch.split(t, _gdn_sizes(m))))
            else:  # GLU fc1: [gate | up]
                hf.update(zip(names, torch.chunk(t, 2)))
        if m.num_experts:
            fc1, fc2, e = _expert_names(i)
            for j, (w1, w2) in enumerate(zip(ours[fc1], ours[fc2])):
                hf[f"{e}.{j}.gate_proj.weight"], hf[f"{e}.{j}.up_proj.weight"] = torch.chunk(w1, 2)
                hf[f"{e}.{j}.down_proj.weight"] = w2
        if m.is_full_attention(i):
            a = f"{HF_PREFIX}layers.{i}.self_attn"
            q, k, v = _attn_qkv_to_hf(ours[f"language_model.decoder.layers.{i}.self_attention.linear_qkv.weight"], m)
            hf[f"{a}.q_proj.weight"], hf[f"{a}.k_proj.weight"], hf[f"{a}.v_proj.weight"] = q, k, v
    for our_name, hf_name in _vision_pairs(m):
        hf[HF_VISION + hf_name] = ours[f"vision_model.{our_name}"]
    v = m.vision
    hf[HF_VISION + "patch_embed.proj.weight"] = ours["vision_model.patch_embed.weight"].reshape(
        v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return {k: t.contiguous() for k, t in hf.items()}


def lora_to_hf(ours: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A, B) of every LoRA adapter in ``ours`` (our ``<layer>.lora_A`` [r, in] /
    ``lora_B`` [out, r]). A fused layer of ours is several HF modules: each gets the same A and
    its rows of B (the rows its weight takes), so B_hf @ A equals those rows of our B @ A."""
    out = {}
    for i in range(m.num_layers):
        pairs = _layer_pairs(m, i)
        if m.is_full_attention(i):
            a = f"{HF_PREFIX}layers.{i}.self_attn"
            pairs.append((f"language_model.decoder.layers.{i}.self_attention.linear_qkv.weight",
                          [f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"]))
        for name, names in pairs:
            base = name[: -len("weight")]
            if not name.endswith(".weight") or base + "lora_A" not in ours:
                continue
            lora_a, lora_b = ours[base + "lora_A"], ours[base + "lora_B"]
            if len(names) == 1:
                rows = [lora_b]
            elif name.endswith("linear_qkv.weight"):
                rows = _attn_qkv_to_hf(lora_b, m)
            elif name.endswith("in_proj.weight"):
                rows = torch.split(lora_b, _gdn_sizes(m))
            else:  # GLU fc1: [gate | up]
                rows = torch.chunk(lora_b, 2)
            for hf_name, b in zip(names, rows):
                out[hf_name[: -len(".weight")]] = (lora_a.contiguous(), b.contiguous())
    return out


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint, single file or sharded with an index."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(d / f)))
    return state


def hf_config_from_ours(m: ModelConfig) -> dict:
    """config.json content for transformers' Qwen3.5 (dense) or Qwen3.5-MoE from our model section."""
    moe = bool(m.num_experts)
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.rms_norm_eps,
        "attention_bias": False,
        "linear_conv_kernel_dim": m.linear_conv_kernel_dim,
        "linear_key_head_dim": m.linear_key_head_dim,
        "linear_value_head_dim": m.linear_value_head_dim,
        "linear_num_key_heads": m.linear_num_key_heads,
        "linear_num_value_heads": m.linear_num_value_heads,
        "layer_types": ["full_attention" if m.is_full_attention(i) else "linear_attention" for i in range(m.num_layers)],
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta,
                            "partial_rotary_factor": m.partial_rotary_factor,
                            "mrope_section": list(m.mrope_section), "mrope_interleaved": m.mrope_interleaved},
        "tie_word_embeddings": m.tie_word_embeddings,
    }
    if 0 <= m.eos_token_id < m.vocab_size:
        text["eos_token_id"] = m.eos_token_id
    if moe:
        text.update(num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                    moe_intermediate_size=m.moe_ffn_hidden_size,
                    shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                    router_aux_loss_coef=m.moe_aux_loss_coeff)
    else:
        text["intermediate_size"] = m.ffn_hidden_size
    v = m.vision
    vision = {
        "model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision",
        "depth": v.depth, "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.spatial_merge_size,
        "out_hidden_size": m.hidden_size, "num_position_embeddings": v.num_position_embeddings,
        "hidden_act": "gelu_pytorch_tanh", "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": m.image_token_id,
        "vision_start_token_id": m.vision_start_token_id,
        "vision_end_token_id": m.vision_end_token_id,
        "video_token_id": m.video_token_id,
        "tie_word_embeddings": m.tie_word_embeddings,
    }
