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
from dataclasses import dataclass
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
    if "mtp_num_layers" in m:  # None in a recipe: as the checkpoint; 0 turns the head off
        hf_mtp = int(t.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0)) or 0)
        m["mtp_num_layers"] = hf_mtp if base is None or m["mtp_num_layers"] is None else m["mtp_num_layers"]
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


def _gdn_sizes(m: ModelConfig) -> list[int]:
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    vd = m.linear_num_value_heads * m.linear_value_head_dim
    return [2 * qk + vd, vd, m.linear_num_value_heads, m.linear_num_value_heads]


@dataclass(frozen=True)
class Source:
    """How one of our (TP=1) tensors is made of HF tensors, and back.

    kind: ``copy`` (one tensor), ``cat`` (concatenated on dim 0; ``sizes`` the row counts, None:
    equal halves), ``qkv`` (attention q/gate, k, v regrouped per query group), ``experts_fc1`` /
    ``experts_fc2`` (per-expert HF tensors stacked on a leading expert axis; fc1 is [gate | up]),
    ``experts_fused`` (HF already stacks them, transformers' fused layout), ``patch`` (Conv3d
    weight <-> flat linear). ``unit``: the group converted together (``embed``, ``layer.<i>``,
    ``mtp.<k>``, ``vision``); a streaming conversion holds one unit at a time, never the model.
    """

    kind: str
    hf: tuple[str, ...]
    unit: str
    sizes: tuple[int, ...] | None = None


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


def _mlp_sources(o: str, h: str, m: ModelConfig, unit: str, fused_experts: bool) -> dict[str, Source]:
    """The dense MLP, or the router, routed experts and shared expert of an MoE layer."""
    def glu(ours: str, hf: str) -> dict[str, Source]:
        return {f"{ours}.linear_fc1.weight": Source("cat", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), unit),
                f"{ours}.linear_fc2.weight": Source("copy", (f"{hf}.down_proj.weight",), unit)}

    if not m.num_experts:
        return glu(o, h)
    out = {f"{o}.router.weight": Source("copy", (f"{h}.gate.weight",), unit)}
    e = f"{h}.experts"
    if fused_experts:  # transformers' own layout: [E, 2F, H] and [E, H, F], as ours
        out[f"{o}.experts.linear_fc1.weight"] = Source("experts_fused", (f"{e}.gate_up_proj",), unit)
        out[f"{o}.experts.linear_fc2.weight"] = Source("experts_fused", (f"{e}.down_proj",), unit)
    else:
        experts = range(m.num_experts)
        out[f"{o}.experts.linear_fc1.weight"] = Source(
            "experts_fc1", tuple(f"{e}.{j}.{p}.weight" for j in experts for p in ("gate_proj", "up_proj")), unit)
        out[f"{o}.experts.linear_fc2.weight"] = Source(
            "experts_fc2", tuple(f"{e}.{j}.down_proj.weight" for j in experts), unit)
    if m.moe_shared_expert_intermediate_size:
        out.update(glu(f"{o}.shared_experts", f"{h}.shared_expert"))
        out[f"{o}.shared_experts.gate_weight"] = Source("copy", (f"{h}.shared_expert_gate.weight",), unit)
    return out


def _layer_sources(o: str, h: str, full_attention: bool, m: ModelConfig, unit: str,
                   fused_experts: bool) -> dict[str, Source]:
    """One decoder layer: ours under prefix ``o``, HF's under ``h``."""
    out = {f"{o}.input_layernorm.weight": Source("copy", (f"{h}.input_layernorm.weight",), unit),
           f"{o}.pre_mlp_layernorm.weight": Source("copy", (f"{h}.post_attention_layernorm.weight",), unit)}
    if full_attention:
        a, s = f"{h}.self_attn", f"{o}.self_attention"
        out.update({
            f"{s}.linear_qkv.weight": Source("qkv", (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
                                             unit),
            f"{s}.q_layernorm.weight": Source("copy", (f"{a}.q_norm.weight",), unit),
            f"{s}.k_layernorm.weight": Source("copy", (f"{a}.k_norm.weight",), unit),
            f"{s}.linear_proj.weight": Source("copy", (f"{a}.o_proj.weight",), unit)})
    else:
        a, s = f"{h}.linear_attn", f"{o}.self_attention"
        out.update({
            f"{s}.in_proj.weight": Source("cat", tuple(f"{a}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), unit,
                                          tuple(_gdn_sizes(m))),
            f"{s}.conv1d.weight": Source("copy", (f"{a}.conv1d.weight",), unit),
            f"{s}.A_log": Source("copy", (f"{a}.A_log",), unit),
            f"{s}.dt_bias": Source("copy", (f"{a}.dt_bias",), unit),
            f"{s}.out_norm.weight": Source("copy", (f"{a}.norm.weight",), unit),
            f"{s}.out_proj.weight": Source("copy", (f"{a}.out_proj.weight",), unit)})
    out.update(_mlp_sources(f"{o}.mlp", f"{h}.mlp", m, unit, fused_experts))
    return out


def mtp_layers(m: ModelConfig) -> int:
    return int(getattr(m, "mtp_num_layers", 0) or 0)


def _mtp_sources(m: ModelConfig, fused_experts: bool) -> dict[str, Source]:
    """Qwen3.5's MTP head: one set of pre-fc norms, fc and final norm (``mtp.*``) around its decoder
    layer(s) (``mtp.layers.<k>``, a gated full-attention layer); ours are megatron's MTP block names."""
    out = {}
    for k in range(mtp_layers(m)):
        o, unit = f"language_model.mtp.layers.{k}", f"mtp.{k}"
        out.update({f"{o}.enorm.weight": Source("copy", ("mtp.pre_fc_norm_embedding.weight",), unit),
                    f"{o}.hnorm.weight": Source("copy", ("mtp.pre_fc_norm_hidden.weight",), unit),
                    f"{o}.eh_proj.weight": Source("copy", ("mtp.fc.weight",), unit)})
        out.update(_layer_sources(f"{o}.transformer_layer", f"mtp.layers.{k}", True, m, unit, fused_experts))
        out[f"{o}.final_layernorm.weight"] = Source("copy", ("mtp.norm.weight",), unit)
    return out


def fused_experts(hf_names) -> bool:
    """Whether a checkpoint stores its experts in transformers' fused layout (``experts.gate_up_proj``)
    rather than per expert, as the releases do."""
    return any(n.endswith("mlp.experts.gate_up_proj") for n in hf_names)


def hf_sources(m: ModelConfig, hf_names=None) -> dict[str, Source]:
    """Every tensor of our full (TP=1) model and the HF tensors it is made of, unit by unit.
    ``hf_names``: the tensors of the checkpoint read (its expert layout); None: the releases' layout."""
    fused = hf_names is not None and fused_experts(hf_names)
    if mtp_layers(m) > 1:
        raise ValueError(f"model.mtp_num_layers={mtp_layers(m)}: Qwen3.5 checkpoints hold one MTP layer's "
                         "shared fc and norms; set model.mtp_num_layers to 0 or 1")
    out = {"language_model.embedding.word_embeddings.weight": Source("copy", (f"{HF_PREFIX}embed_tokens.weight",),
                                                                     "embed"),
           "language_model.decoder.final_layernorm.weight": Source("copy", (f"{HF_PREFIX}norm.weight",), "embed")}
    if not m.tie_word_embeddings:
        out["language_model.output_layer.weight"] = Source("copy", ("lm_head.weight",), "embed")
    for i in range(m.num_layers):
        out.update(_layer_sources(f"language_model.decoder.layers.{i}", f"{HF_PREFIX}layers.{i}",
                                  m.is_full_attention(i), m, f"layer.{i}", fused))
    out.update(_mtp_sources(m, fused))
    for ours, hf_name in _vision_pairs(m):
        out[f"vision_model.{ours}"] = Source("copy", (HF_VISION + hf_name,), "vision")
    out["vision_model.patch_embed.weight"] = Source("patch", (HF_VISION + "patch_embed.proj.weight",), "vision")
    return out


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


def build_from_hf(src: Source, get, m: ModelConfig) -> torch.Tensor:
    """Our whole tensor from its whole HF tensors (``get(name)``): the in-memory path (hf_to_ours)
    and the reference the sliced reads of ``hf_rows`` are tested against."""
    if src.kind == "copy":
        return get(src.hf[0])
    if src.kind == "cat":
        return torch.cat([get(n) for n in src.hf])
    if src.kind == "qkv":
        return _attn_qkv_from_hf(*(get(n) for n in src.hf), m)
    if src.kind == "patch":
        w = get(src.hf[0])
        return w.reshape(w.shape[0], -1)
    if src.kind == "experts_fused":
        return get(src.hf[0])
    if src.kind == "experts_fc1":
        return torch.stack([torch.cat([get(src.hf[2 * j]), get(src.hf[2 * j + 1])]) for j in range(m.num_experts)])
    if src.kind == "experts_fc2":
        return torch.stack([get(src.hf[j]) for j in range(m.num_experts)])
    raise ValueError(f"unknown source kind {src.kind}")


def hf_rows(src: Source, m: ModelConfig, width: int, shape_of) -> list[tuple[int, str, int, int]]:
    """Where each row of our tensor comes from, with our tensor and each HF tensor seen as matrices
    of ``width`` columns (our last dim) in storage order: ``(our first row, HF name, its first row,
    rows)`` runs, in our row order. Every kind is rows of its HF tensors: copied (a patch weight's
    Conv3d shape flattens to the same rows), concatenated (GDN's [qkv | z | b | a], fc1's
    [gate | up], experts stacked expert by expert), or, for attention, q/gate/k/v regrouped per query
    group in runs of one head. So any rows (and columns) of ours are read from the files alone."""
    def rows(name: str) -> int:
        n = 1
        for d in shape_of(name):
            n *= d
        return n // width

    out, r = [], 0
    if src.kind == "qkv":
        hd, nq, ng = m.head_dim, m.num_attention_heads, m.num_query_groups
        per = nq // ng
        q, k, v = src.hf
        for g in range(ng):
            for half in (0, 1):  # HF's q_proj holds, per head, [q_h | gate_h]; ours: a group's q heads, then its gates
                for h in range(g * per, (g + 1) * per):
                    out.append((r, q, (2 * h + half) * hd, hd))
                    r += hd
            for name in (k, v):
                out.append((r, name, g * hd, hd))
                r += hd
        return out
    if src.kind not in ("copy", "cat", "patch", "experts_fused", "experts_fc1", "experts_fc2"):
        raise ValueError(f"unknown source kind {src.kind}")
    for name in src.hf:  # in hf_sources' order: the order of our rows
        out.append((r, name, 0, rows(name)))
        r += rows(name)
    return out


def split_to_hf(src: Source, t: torch.Tensor, m: ModelConfig, first_expert: int = 0) -> dict[str, torch.Tensor]:
    """The HF tensors of one of ours (the inverse of ``build_from_hf``); views where possible. A
    stacked expert weight may be a group of experts from ``first_expert`` on."""
    if src.kind == "experts_fused" and (first_expert or t.shape[0] != m.num_experts):
        raise ValueError("transformers' fused expert layout is written whole, not by expert group")
    if src.kind in ("copy", "experts_fused"):
        return {src.hf[0]: t}
    if src.kind == "cat":
        parts = torch.split(t, list(src.sizes)) if src.sizes else torch.chunk(t, 2)
        return dict(zip(src.hf, parts))
    if src.kind == "qkv":
        return dict(zip(src.hf, _attn_qkv_to_hf(t, m)))
    if src.kind == "patch":
        v = m.vision
        return {src.hf[0]: t.reshape(v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)}
    if src.kind == "experts_fc1":
        out = {}
        for j, w in enumerate(t, first_expert):
            out[src.hf[2 * j]], out[src.hf[2 * j + 1]] = torch.chunk(w, 2)
        return out
    if src.kind == "experts_fc2":
        return {src.hf[j]: w for j, w in enumerate(t, first_expert)}
    raise ValueError(f"unknown source kind {src.kind}")


def hf_to_ours(hf: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Full (TP=1) state dict of our model from an HF state dict held in memory (small models,
    parity tools; scripts/convert_hf.py streams unit by unit). Raises on missing tensors."""
    def get(name):
        try:
            return hf[name]
        except KeyError:
            raise KeyError(f"HF checkpoint lacks {name}") from None

    return {ours: build_from_hf(src, get, m) for ours, src in hf_sources(m, hf).items()}


def ours_to_hf(ours: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (on-disk names) from our full (TP=1) state dict; inverse of hf_to_ours."""
    hf: dict[str, torch.Tensor] = {}
    for name, src in hf_sources(m).items():
        hf.update(split_to_hf(src, ours[name], m))
    return {k: t.contiguous() for k, t in hf.items()}


def lora_to_hf(ours: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A, B) of every LoRA adapter in ``ours`` (our ``<layer>.lora_A`` [r, in] /
    ``lora_B`` [out, r]). A fused layer of ours is several HF modules: each gets the same A and
    its rows of B (the rows its weight takes), so B_hf @ A equals those rows of our B @ A."""
    out = {}
    for name, src in hf_sources(m).items():
        base = name[: -len("weight")]
        if not name.endswith(".weight") or base + "lora_A" not in ours or src.kind not in ("copy", "cat", "qkv"):
            continue
        lora_a = ours[base + "lora_A"].contiguous()
        for hf_name, b in split_to_hf(src, ours[base + "lora_B"], m).items():
            out[hf_name[: -len(".weight")]] = (lora_a, b.contiguous())
    return out


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint, single file or sharded with an index, in memory
    (small models, the parity tools; conversion streams through ``SafetensorsFolder`` instead)."""
    from core.safetensors_io import SafetensorsFolder

    folder = SafetensorsFolder(hf_dir)
    try:
        return {name: folder.get(name) for name in folder.names}
    finally:
        folder.close()


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
    text["mtp_num_hidden_layers"] = mtp_layers(m)
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
