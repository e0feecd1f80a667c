"""Qwen3.5-VL's parameter and activation model for the dry run (multimodal/dry_run.py).

Parameters one rank holds, counted from the recipe's shapes the way megatron-core and our modules
allocate them (tests/test_dry_run.py proves the count equal to ``sum(p.numel())`` of the built
model), and the bytes of activations each decoder layer kind and each image patch keeps for
backward. Sharding (megatron-core's, as the trainer sets it up):
- Tensor parallel shards: the vocabulary (embedding, output layer), attention's fused
  q|gate|k|v and output projections, GDN's in_proj, conv1d, A_log, dt_bias and out_proj, the
  dense MLP and the shared expert. Replicated on every TP rank: all norms (decoder norms, q/k
  norms, the GDN gated norm), the MoE router, the shared-expert gate and the whole vision encoder.
- Experts: ``num_experts / ep`` per rank, each sharded over expert-TP = tp.
- Decoder layers are split evenly over PP stages; the embedding and the vision encoder live on
  the first stage, the final norm and the output layer on the last (tied embeddings with pp > 1:
  the last stage holds its own copy of the embedding matrix as the output weight).
"""

from __future__ import annotations

from models.family import StageParams
from models.qwen35_vl.config import ModelConfig


def merger_params(m: ModelConfig) -> int:
    """The 2x2 patch merger: LayerNorm, fc1, fc2 (with biases)."""
    h = m.vision.hidden_size
    merged = h * m.vision.spatial_merge_size**2
    return 2 * h + (merged * merged + merged) + (merged * m.hidden_size + m.hidden_size)


def vision_params(m: ModelConfig) -> int:
    """models/qwen35_vl/vision.py: patch embed, learned positions, ViT blocks, 2x2 merger (all with biases)."""
    v = m.vision
    h, f = v.hidden_size, v.intermediate_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h)
    return (patch * h + h) + v.num_position_embeddings * h + v.depth * block + merger_params(m)


def gdn_params(m: ModelConfig, tp: int) -> int:
    """megatron GatedDeltaNet: in_proj [q|k|v|z|beta|alpha], depthwise conv1d over q|k|v (no bias),
    A_log and dt_bias per value head, all TP-sharded; the gated out_norm (one value head wide) is
    replicated; out_proj is row-parallel."""
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    nv = m.linear_num_value_heads
    in_proj = m.hidden_size * (2 * qk + 2 * v + 2 * nv) // tp
    conv = (2 * qk + v) // tp * m.linear_conv_kernel_dim
    return in_proj + conv + 2 * nv // tp + m.linear_value_head_dim + v // tp * m.hidden_size


def attention_params(m: ModelConfig, tp: int) -> int:
    """Gated attention: fused q|gate|k|v (column-parallel), output projection (row-parallel), q/k norms."""
    q = m.num_attention_heads * m.head_dim
    kv = m.num_query_groups * m.head_dim
    return m.hidden_size * (2 * q + 2 * kv) // tp + q // tp * m.hidden_size + 2 * m.head_dim


def mlp_params(m: ModelConfig, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one layer's MLP block on one rank (SwiGLU: fc1 = [gate|up])."""
    h = m.hidden_size
    if not m.num_experts:
        return 3 * h * m.ffn_hidden_size // tp, 0
    dense = m.num_experts * h  # router, replicated
    if m.moe_shared_expert_intermediate_size:
        dense += 3 * h * m.moe_shared_expert_intermediate_size // tp + h  # shared expert + its gate
    experts = m.num_experts // ep * 3 * h * m.moe_ffn_hidden_size // tp  # expert TP = tp
    return dense, experts


def lora_params(m: ModelConfig, n_gdn: int, n_attn: int, tp: int = 1) -> int:
    """Adapter parameters on one TP rank of ``model.lora`` on ``n_gdn`` GDN and ``n_attn``
    attention layers (multimodal/lora.py's targets): rank x (in + out / tp) per column-parallel
    layer (A whole, B split), rank x (in / tp + out) per row-parallel one (A split, B whole)."""
    lora = getattr(m, "lora", None)
    if lora is None or not lora.rank:
        return 0
    h, t = m.hidden_size, set(lora.targets)
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    gdn = (("in_proj" in t) * (h + (2 * qk + 2 * v + 2 * m.linear_num_value_heads) // tp)
           + ("out_proj" in t) * (v // tp + h))
    attn = ("linear_qkv" in t) * (h + (2 * q + 2 * kv) // tp) + ("linear_proj" in t) * (q // tp + h)
    if m.num_experts:
        s = m.moe_shared_expert_intermediate_size or 0
        mlp = ("shared_experts" in t) * bool(s) * (h + 2 * s // tp + s // tp + h)
    else:
        f = m.ffn_hidden_size
        mlp = ("linear_fc1" in t) * (h + 2 * f // tp) + ("linear_fc2" in t) * (f // tp + h)
    return lora.rank * (n_gdn * (gdn + mlp) + n_attn * (attn + mlp))


def stage_layers(m: ModelConfig, pp: int, stage: int) -> range:
    per = m.num_layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_params(m: ModelConfig, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> StageParams:
    """Parameters one rank of pipeline stage ``stage`` holds (every TP/CP/EP/DP rank of a stage holds as many)."""
    h, first, last = m.hidden_size, stage == 0, stage == pp - 1
    layers = stage_layers(m, pp, stage)
    n_attn = sum(m.is_full_attention(i) for i in layers)
    n_gdn = len(layers) - n_attn
    kinds = {"gdn": n_gdn, "attention": n_attn}  # the keys of activation_bytes_per_token
    dense_mlp, expert_mlp = mlp_params(m, tp, ep)
    # MTP depths (last stage): eh_proj [H, 2H] (column-parallel), a full-attention layer, 5 norms
    depth = getattr(m, "mtp_num_layers", 0) if last else 0
    if depth:
        kinds["mtp"] = depth
    mtp_experts = depth * expert_mlp
    parts = {
        "embedding": m.vocab_size // tp * h if first else 0,
        "vision": vision_params(m) if first else 0,
        "gdn": n_gdn * gdn_params(m, tp),
        "attention": n_attn * attention_params(m, tp),
        "norms": len(layers) * 2 * h + (h if last else 0),
        "mlp": len(layers) * dense_mlp,
        "experts": len(layers) * expert_mlp,
        # untied: its own matrix; tied: shared with the embedding on one stage, a synced copy when pp > 1
        "output": m.vocab_size // tp * h if last and (not m.tie_word_embeddings or not first) else 0,
        "mtp": depth * (2 * h * h // tp + attention_params(m, tp) + dense_mlp + 5 * h) + mtp_experts,
    }
    frozen_by_group = {
        "vision": parts["vision"] - (merger_params(m) if first else 0),
        "merger": merger_params(m) if first else 0,
        "language": sum(parts[k] for k in ("gdn", "attention", "norms", "mlp", "experts")),
        "embedding": parts["embedding"],
        "lm_head": parts["output"],
        "mtp": parts["mtp"],
    }
    freeze = set(getattr(m, "freeze", ()))
    frozen = sum(n for g, n in frozen_by_group.items() if g in freeze)
    lora = getattr(m, "lora", None)
    if lora is not None and lora.rank:  # model.lora: every base weight frozen, the adapters train
        frozen = sum(parts.values())
        parts["lora"] = lora_params(m, n_gdn, n_attn + depth, tp)  # the MTP layers' linears too
        experts = parts["experts"] + mtp_experts
        return StageParams(stage, kinds, parts, experts, frozen, experts)
    return StageParams(stage, kinds, parts, parts["experts"] + mtp_experts, frozen,
                       parts["experts"] * ("language" in freeze) + mtp_experts * ("mtp" in freeze))


def model_params(m: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of the whole model, each weight counted once."""
    full = stage_params(m)
    total = full.total
    active = total
    if m.num_experts:
        per_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
        active -= (m.num_layers + m.mtp_num_layers) * (m.num_experts - m.moe_router_topk) * per_expert
    return total, active



def activation_bytes_per_token(m: ModelConfig, lay) -> dict[str, float]:
    """Bytes of saved activations per token of a micro-batch for one decoder layer of each kind
    (``lay``: the layout, read for ``tp`` and ``sequence_parallel``).

    bf16 tensors kept for backward, no recomputation; TP-sharded tensors are divided by tp,
    hidden-sized ones (norm inputs/outputs) too under sequence parallel. With a = heads,
    g = KV groups, d = head_dim, h = hidden, f = ffn, K/V = GDN key/value widths, nv = GDN value
    heads, dk = key head dim, E/k/fe/fs = experts/top-k/expert ffn/shared ffn:
      every layer    8h          two RMSNorms: input + output
      MTP depth      an attention layer + 12h: enorm/hnorm in/out, the [e, h] concat (eh_proj's
                                  input), its output
      attention      12ad + 8gd  q|gate|k|v, normed q/k, rotated q/k, attention out, gated out
      GDN            8K + 14V + 4*nv*dk + 266*nv
                                  in_proj out, conv out, l2-normed q/k repeated to nv heads, v, z,
                                  core out, norm in/out, fp32 decay/beta and the chunk-64 fp32
                                  intra-chunk matrix of the delta rule
      dense MLP      8f          fc1 out [gate|up], silu(gate), product (fc2 input)
      MoE            8E + k(4h + 8fe/tp) + 8fs/tp
                                  fp32 router logits + probs; per routed copy: the permuted input
                                  (fc1's input), expert fc1/act/product, the expert output (kept to
                                  weight it by its routing prob); the shared expert. Routed
                                  copies are not divided by tp: with expert-TP the dispatcher
                                  all-gathers the TP ranks' tokens.
    Context parallel divides the tokens (each rank keeps seq/cp of every sequence; GDN's
    head-parallel all-to-all trades tokens for heads at the same byte count).
    """
    t = lay.tp
    sp = t if lay.sequence_parallel else 1
    a, g, d, h = m.num_attention_heads, m.num_query_groups, m.head_dim, m.hidden_size
    qk = m.linear_num_key_heads * m.linear_key_head_dim
    v = m.linear_num_value_heads * m.linear_value_head_dim
    nv, dk = m.linear_num_value_heads, m.linear_key_head_dim
    common = 8 * h / sp
    if m.num_experts:
        fs = m.moe_shared_expert_intermediate_size
        mlp = (8 * m.num_experts / sp + m.moe_router_topk * (4 * h + 8 * m.moe_ffn_hidden_size / t)
               + 8 * fs / t)
    else:
        mlp = 8 * m.ffn_hidden_size / t
    attention = common + (12 * a * d + 8 * g * d) / t + mlp
    return {
        "attention": attention,
        "mtp": attention + 12 * h / sp,
        "gdn": common + (8 * qk + 14 * v + 4 * nv * dk + 266 * nv) / t + mlp,
    }


def vision_bytes_per_patch(m: ModelConfig) -> float:
    """Per ViT block: two LayerNorms in/out, qkv, rotated q/k, attention out, fc1 out, gelu out."""
    h, f = m.vision.hidden_size, m.vision.intermediate_size
    return m.vision.depth * (20 * h + 4 * f)
