"""megatron-core's GPTModel with the LM loss through fused_kernels/fused_linear_ce.py: the decoder every
family builds on (its rotary embedding is the family's, in ``_preprocess``)."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel


class FusedLossGPTModel(GPTModel):
    # Loss through fused_kernels.fused_linear_ce (no [tokens, vocab] logits); set by the family's build
    # from model.fused_linear_ce. False keeps megatron's output layer + vocab_parallel_cross_entropy.
    fused_linear_ce: bool = False
    # How the fused LM head hands back its weight gradient: "autograd", or into main_grad
    # ("main_grad" / "main_grad_only"), set by models/performance/wgrad_fusion.enable
    lm_head_grad: str = "autograd"
    # model.mtp_num_layers: the MTP block (models/common/mtp.py) as ``self.mtp``, and the shifted
    # inputs MultimodalModel.forward hands over for one forward (read and dropped in _postprocess)
    mtp_batch: dict | None = None

    def lm_head_weight(self) -> torch.Tensor:
        """Tied: the (vocab-parallel) embedding weight; untied: the output layer's. Both are
        [V/TP, H] shards along the vocabulary, as vocab_parallel_cross_entropy expects."""
        return (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                else self.output_layer.weight)

    def _postprocess(self, hidden_states, **kwargs):
        mtp_batch, self.mtp_batch = self.mtp_batch, None
        out = self._lm_postprocess(hidden_states, **kwargs)
        if mtp_batch is not None and self.post_process and kwargs.get("labels") is not None:
            self._mtp_loss(hidden_states, mtp_batch, kwargs)
        return out

    def _mtp_loss(self, hidden_states, batch: dict, kwargs: dict) -> None:
        """Runs the MTP depths on the decoder output (after its final norm) and leaves their loss
        term and report in ``batch["out"]`` for forward_step's loss function."""
        from models.common.mtp import mtp_losses  # noqa: PLC0415

        # (the schedule plan's post-process node passes no padding mask; it puts it in the batch)
        mask = batch.get("padding_mask", kwargs.get("padding_mask"))
        hs = self.mtp(hidden_states, batch["embeds"], rotary_pos_emb=kwargs.get("rotary_pos_emb"),
                      packed_seq_params=kwargs.get("packed_seq_params"), padding_mask=mask)
        index = batch.get("token_index") or [None] * len(hs)  # model.sparse_lm_head: each depth's loss tokens
        losses = [self._token_losses(h, batch["labels"][k], index[k]) for k, h in enumerate(hs)]
        term, report = mtp_losses(losses, batch["loss_mask"], batch["ratios"], batch["scale"])
        batch["out"].update(loss=term, report=report)

    def _token_losses(self, hidden_states, labels, token_index=None):
        """Per-token CE [B, S] of hidden states [S, B, H] through this model's LM head (the tied
        embedding or the output layer): the MTP depths share it, as vLLM's Qwen3_5MTP does. With
        ``token_index`` (the fused loss only) the head runs at those tokens; the rest are zero."""
        if self.fused_linear_ce:
            from fused_kernels.fused_linear_ce import vocab_parallel_linear_cross_entropy  # noqa: PLC0415

            return vocab_parallel_linear_cross_entropy(
                hidden_states, self.lm_head_weight(), labels, tp_group=self.tp_group,
                sequence_parallel=self.output_layer.sequence_parallel, token_index=token_index,
                weight_grad=self.lm_head_grad)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)
        return self.compute_language_model_loss(labels, logits)

    def _lm_postprocess(self, hidden_states, **kwargs):
        from megatron.core.inference.utils import InferenceMode  # noqa: PLC0415

        labels = kwargs.get("labels")
        if (not self.fused_linear_ce or not self.post_process or labels is None or self.mtp_process
                or kwargs.get("output_processor") is not None or InferenceMode.is_active()
                or self.config.use_mup):
            return super()._postprocess(hidden_states=hidden_states, **kwargs)
        from fused_kernels.fused_linear_ce import vocab_parallel_linear_cross_entropy  # noqa: PLC0415

        weight = self.lm_head_weight()
        # model.sparse_lm_head: forward_step put the loss tokens' indices on packed batches
        index = getattr(kwargs.get("packed_seq_params"), "loss_token_index", None)
        return vocab_parallel_linear_cross_entropy(
            hidden_states, weight, labels, tp_group=self.tp_group,
            sequence_parallel=self.output_layer.sequence_parallel, token_index=index, weight_grad=self.lm_head_grad)
