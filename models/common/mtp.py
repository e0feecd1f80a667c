"""Multi-token prediction (MTP): the head the released Qwen3.5 checkpoints carry for speculative
decoding, trained beside the LM loss (``model.mtp_num_layers``, ``model.mtp_loss_scale``).

Depth k (1-based) at position t: ``h_k = final_layernorm(layer(eh_proj([enorm(e_{t+k}), hnorm(h_{k-1})])))``
where ``h_0`` is the decoder output after its final norm and ``e_{t+k}`` the input embedding of
token t+k (image features at image tokens); it predicts token t+k+1 (``labels[t+k]``) through the
model's own LM head. The conventions are vLLM's (docs/checkpoints.md#mtp cites them).

The shift is done on the host, on the whole micro-batch, before the context-parallel split
(``shift_batch``): every MTP input and target then sits at the same position t as the hidden
state it is combined with, so CP chunk boundaries need no exchange (megatron's ``roll_tensor``
would, and assumes its own chunking), and a packed sample's shifted tokens never come from the
next sample. The parameter names are megatron-core's MultiTokenPredictionBlock's, with the inner
layer named ``transformer_layer`` (the names the HF mapping uses); megatron's block itself is not
used because it rolls on the device and re-embeds token ids, which loses the image features.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from core.vision_tokens import vision_token_mask
from models.common.norms import RMSNorm

MTP_KEYS = ("mtp_tokens", "mtp_labels", "mtp_loss_mask", "mtp_ordinal")


def _segment_ids(n: int, row: int, cu: torch.Tensor | None) -> torch.Tensor:
    """Sample id of every flat position: packed rows by ``cu`` (padded bounds), else one per row."""
    pos = torch.arange(n)
    if cu is None:
        return pos // row
    return torch.bucketize(pos, cu[1:].to(torch.long), right=True)


def shift_batch(batch: dict, depth: int, image_token_id) -> dict:
    """Host tensors [depth, B, S] for MTP: at depth k (row k-1), position t holds token t+k, its
    label and loss mask, and the ordinal of its image feature, from the same sample only (0 and a
    zero mask where t+k is past the sample's end)."""
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
    b, s = tokens.shape
    n = b * s
    cu = batch.get("cu_seqlens_padded")
    cu = batch.get("cu_seqlens") if cu is None else cu
    seg = _segment_ids(n, s, cu)
    is_image = vision_token_mask(tokens, image_token_id).reshape(-1)
    ordinal = is_image.cumsum(0) - 1  # row of the micro-batch's vision features, at image tokens
    flat = {"mtp_tokens": tokens.reshape(-1), "mtp_labels": labels.reshape(-1),
            "mtp_loss_mask": mask.reshape(-1), "mtp_ordinal": ordinal}
    out = {k: [] for k in flat}
    for k in range(1, depth + 1):
        src = torch.arange(n) + k
        valid = src < n
        src = src.clamp(max=n - 1)
        valid &= seg[src] == seg
        for key, x in flat.items():
            out[key].append(torch.where(valid, x[src], torch.zeros_like(x[src])).reshape(b, s))
    return {k: torch.stack(v) for k, v in out.items()}


class MTPLayer(MegatronModule):
    """One MTP depth: enorm, hnorm, eh_proj [H, 2H] (input [embedding, hidden]), one decoder layer,
    final_layernorm: the names of megatron's MultiTokenPredictionLayer."""

    def __init__(self, config, layer_spec, layer_number: int, vp_stage: int | None = None):
        super().__init__(config=config)
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.enorm = RMSNorm(config=config, hidden_size=h, eps=eps)
        self.hnorm = RMSNorm(config=config, hidden_size=h, eps=eps)
        # column-parallel like megatron's eh_proj: under SP it gathers the sequence itself
        self.eh_proj = ColumnParallelLinear(2 * h, h, config=config, init_method=config.init_method,
                                            gather_output=False, bias=False, skip_bias_add=False)
        # layer_number as given on every pipeline stage (add_layer_offset=False): the last stage's
        # offset would move the MTP layer's MoE aux-loss slot with the layout. megatron's
        # is_mtp_layer would instead file it past the decoder's layers, in a tracker sized without them
        self.transformer_layer = build_module(layer_spec, config=config, layer_number=layer_number, vp_stage=vp_stage,
                                              add_layer_offset=False)
        self.final_layernorm = RMSNorm(config=config, hidden_size=h, eps=eps)

    def forward(self, hidden, emb, rotary_pos_emb=None, packed_seq_params=None, padding_mask=None):
        x = torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1)  # embedding first, as in HF mtp.fc
        x, _ = self.eh_proj(x)
        x = tensor_parallel.gather_from_tensor_model_parallel_region(x)
        if self.config.sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        kw = {"padding_mask": padding_mask} if padding_mask is not None else {}
        x, _ = self.transformer_layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
                                      packed_seq_params=packed_seq_params, **kw)
        return self.final_layernorm(x)


class MTPBlock(MegatronModule):
    """``num_layers`` MTP depths; depth k reads depth k-1's output (after its final norm), as
    vLLM chains its draft steps and megatron its MTP layers."""

    def __init__(self, config, layer_spec, num_layers: int, vp_stage: int | None = None):
        super().__init__(config=config)
        # layer_number 1..D: the MTP layers keep their own numbering, as megatron's do (the MoE
        # aux-loss tracker is sized by the decoder's layer count)
        self.layers = torch.nn.ModuleList(MTPLayer(config, layer_spec, k + 1, vp_stage) for k in range(num_layers))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Each layer's own sharded state dict: megatron's default treats a ModuleList as plain
        tensors, which would store the TP-split linears with their local shapes."""
        out = {}
        for k, layer in enumerate(self.layers):
            out.update(layer.sharded_state_dict(f"{prefix}layers.{k}.", sharded_offsets, metadata))
        return out

    def forward(self, hidden, embeds: list[torch.Tensor], **kw) -> list[torch.Tensor]:
        outs = []
        for layer, emb in zip(self.layers, embeds):
            hidden = layer(hidden, emb, **kw)
            outs.append(hidden)
        return outs


def mtp_losses(token_losses: list[torch.Tensor], loss_mask: torch.Tensor, ratios: list[float], scale: float):
    """Per-depth per-token losses [B, S] and the shifted masks [D, B, S] -> (the term added to the LM
    loss sum, its report [sum, tokens]).

    In megatron's per-token-loss form the summed loss is divided once by the LM's token count
    (finalize_model_grads); so, like megatron's process_mtp_loss, each depth's sum is multiplied
    by (LM tokens / its tokens) of the micro-batch (host numbers here, no sync), making the term
    ``scale/D * mean MTP loss`` per micro-batch."""
    d = len(token_losses)
    total, report = 0.0, torch.zeros(2, device=loss_mask.device)
    for k, tok in enumerate(token_losses):
        m = loss_mask[k].to(torch.float32)
        s = (tok.float() * m).sum()
        total = total + s * (scale / d * ratios[k])
        report = report + torch.stack([s.detach(), m.sum()])
    return total, report
