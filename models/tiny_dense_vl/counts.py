"""tiny_dense_vl's FLOPs, parameter counts and activation bytes (the dry run's and MFU's inputs).

Per decoder layer: RMSNorm, q|k|v projection ((a + 2g) d outputs, TP-sharded), output projection,
RMSNorm, SwiGLU MLP (fc1 [gate|up] 2f, fc2). Vision: patch embedding (with bias) -> gelu ->
LayerNorm -> merger of merge^2 patches (with bias). tests/test_model_family.py checks the counts
against the built model.
"""

from __future__ import annotations

from collections.abc import Iterable

from models.common.training_passes import TrainingPasses

from models.family import StageParams


def _attention(m, tp: int) -> int:
    a, g, d, h = m.num_attention_heads, m.num_query_groups, m.head_dim, m.hidden_size
    return h * (a + 2 * g) * d // tp + a * d * h // tp


def _mlp(m, tp: int) -> int:
    return 3 * m.hidden_size * m.ffn_hidden_size // tp


def _vision(m) -> tuple[int, int]:
    """(patch embedding + norm, merger) parameters."""
    v = m.vision
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    embed = (patch_dim + 1) * v.hidden_size + 2 * v.hidden_size  # linear with bias, LayerNorm
    return embed, (v.hidden_size * v.spatial_merge_size**2 + 1) * m.hidden_size


def stage_params(m, tp: int = 1, pp: int = 1, ep: int = 1, stage: int = 0) -> StageParams:
    h, first, last = m.hidden_size, stage == 0, stage == pp - 1
    n = m.num_layers // pp
    embed, merger = _vision(m) if first else (0, 0)
    parts = {
        "embedding": m.vocab_size // tp * h if first else 0,
        "vision": embed + merger,
        "attention": n * _attention(m, tp),
        "norms": n * 2 * h + (h if last else 0),
        "mlp": n * _mlp(m, tp),
        # untied: its own matrix; tied: shared with the embedding on one stage, a synced copy when pp > 1
        "output": m.vocab_size // tp * h if last and (not m.tie_word_embeddings or not first) else 0,
    }
    groups = {"vision": embed, "merger": merger, "language": parts["attention"] + parts["norms"] + parts["mlp"],
              "embedding": parts["embedding"], "lm_head": parts["output"]}
    frozen = sum(count for group, count in groups.items() if group in m.freeze)
    return StageParams(stage, {"attention": n}, parts, frozen=frozen)


def model_params(m) -> tuple[int, int]:
    total = stage_params(m).total
    return total, total  # dense: every parameter is active for every token


def activation_bytes_per_token(m, lay) -> dict[str, float]:
    """bf16 tensors one layer keeps for backward: the two norms' inputs and outputs (8h), q|k|v
    (2(a+2g)d), rotated q and k (2(a+g)d), the attention output (2ad), and the MLP's fc1 output,
    silu and product (8f); TP-sharded ones divided by tp, hidden-sized ones too under SP."""
    a, g, d, h, f = m.num_attention_heads, m.num_query_groups, m.head_dim, m.hidden_size, m.ffn_hidden_size
    sp = lay.tp if lay.sequence_parallel else 1
    return {"attention": 8 * h / sp + (6 * a * d + 6 * g * d + 8 * f) / lay.tp}


def vision_bytes_per_patch(m) -> float:
    """The patch embedding's output, its gelu and its norm (bf16), for backward."""
    return 6 * m.vision.hidden_size


def training_flops(m, sample_lengths: Iterable[int], image_grids: Iterable[tuple[int, int, int]],
                   lm_head_tokens: int | None = None, mtp_head_tokens: int | None = None) -> float:
    """Forward + backward FLOPs of the real samples: 2 x multiply-accumulates of every matmul, causal
    attention scores 4ad per (query, key) pair inside each sample, the LM head at ``lm_head_tokens``
    tokens (None: every real token), the vision path per patch; 3 x forward for what trains, less
    for frozen parts (models/common/training_passes.py). This family has no MTP head
    (``mtp_head_tokens`` is always None here)."""
    passes = TrainingPasses.of(m)
    h, a, d = m.hidden_size, m.num_attention_heads, m.head_dim
    lengths = list(sample_lengths)
    weights = m.num_layers * 2 * (_attention(m, 1) + _mlp(m, 1)) * sum(lengths)
    scores = m.num_layers * 4 * a * d * sum(L * (L + 1) / 2 for L in lengths)
    head = 2 * h * m.vocab_size * (sum(lengths) if lm_head_tokens is None else lm_head_tokens)
    v = m.vision
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    patches = sum(t * gh * gw for t, gh, gw in image_grids)
    return (passes.decoder_weights * weights + passes.decoder_core * scores + passes.lm_head * head
            + passes.vision * patches * 2 * patch_dim * v.hidden_size + passes.merger * patches * 2 * v.hidden_size * h)
