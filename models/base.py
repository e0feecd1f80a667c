"""MultimodalModel: vision encoder -> image embeddings scattered into token embeddings -> decoder.

Any model family plugs in here with a megatron GPTModel-like decoder (``embedding``,
``forward(..., decoder_input=...)``, ``set_input_tensor``) and an optional vision encoder
mapping ``(pixel_values, image_grid_thw)`` to one row per image token.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from core.vision_tokens import vision_token_mask
from models.common.cp_collectives import VisionGather


def scatter_image_features(emb: torch.Tensor, is_image: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """``emb`` [S, B, H] with row k of ``features`` at the k-th image token in [B, S] order
    (features are ordered by sample, then position; the data pipeline has checked that image
    tokens and features agree in number).

    Not ``masked_scatter``: its backward calls ``nonzero`` on the mask, a host sync that drains
    the GPU queue once per step and leaves the GPU idle while the host catches up. The number of
    image tokens is known on the host (the features' length), so ``nonzero_static`` finds their
    positions without a sync, and ``index_copy`` / its backward (``index_select``) need none
    either."""
    S, B, H = emb.shape
    pos = torch.nonzero_static(is_image.reshape(-1), size=features.shape[0]).squeeze(1)
    flat = emb.transpose(0, 1).reshape(B * S, H)
    return flat.index_copy(0, pos, features.to(flat.dtype)).view(B, S, H).transpose(0, 1)


# The parts ``model.freeze`` names (multimodal/freeze.py); ``MultimodalModel.parameter_group``
# says which one a parameter belongs to.
PARAMETER_GROUPS = ("vision", "merger", "language", "embedding", "lm_head", "mtp")


class MultimodalModel(MegatronModule):
    def __init__(self, config, language_model, vision_model, image_token_id: int | tuple[int, ...], pre_process: bool = True,
                 post_process: bool = True):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        self.language_model = language_model
        # The vision encoder lives on the first pipeline stage only.
        self.vision_model = vision_model if pre_process else None
        self.image_token_id = image_token_id  # the placeholder id(s) vision features replace: image, video
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = language_model.share_embeddings_and_output_weights
        self.received_mtp_embeds = None  # set_input_tensor's share of the previous stage's output

    def parameter_group(self, name: str) -> str:
        """The PARAMETER_GROUPS entry of a parameter, by its name in ``named_parameters()``."""
        if name.startswith("vision_model."):
            return self.vision_model.parameter_group(name[len("vision_model."):])
        if name.startswith("language_model.embedding."):
            return "embedding"
        if name.startswith("language_model.output_layer."):
            return "lm_head"
        if name.startswith("language_model.mtp."):
            return "mtp"
        return "language"

    @property
    def mtp_depth(self) -> int:
        """The MTP depths the model trains (the language model's ``mtp_num_layers``), on every stage."""
        return int(getattr(self.language_model, "mtp_num_layers", 0) or 0)

    @property
    def stage_tokens_per_token(self) -> int:
        """How many [S, B, H] blocks one pipeline stage sends the next: the hidden states, then
        with MTP the input embeddings of each depth, which only the first stage can compute
        (its vision encoder gives the image features) and the last stage's MTP head needs.
        Megatron's schedule sizes its send and receive buffers by ``seq_length`` times this."""
        return 1 + self.mtp_depth

    def set_input_tensor(self, input_tensor) -> None:
        """The previous stage's output: hidden states for the decoder, then (with MTP) the depths'
        input embeddings, kept for this stage's MTP head or passed on. Slices of the received
        tensor, so the backward returns their gradients to the previous stage through it."""
        received = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor
        self.received_mtp_embeds = None
        if received is not None and self.mtp_depth and not self.pre_process:
            blocks = received.chunk(self.stage_tokens_per_token, dim=0)
            received, self.received_mtp_embeds = blocks[0], list(blocks[1:])
        self.language_model.set_input_tensor(received)

    def shared_embedding_or_output_weight(self):
        return self.language_model.shared_embedding_or_output_weight()

    def embed(self, tokens: torch.Tensor, pixel_values: torch.Tensor | None,
              image_grid_thw: torch.Tensor | None, image_feature_index: torch.Tensor | None = None,
              vision_gather: tuple | None = None) -> torch.Tensor:
        """Token embeddings [S, B, H] with image features at the image-token positions.

        Under context parallelism ``tokens`` are this rank's share of the sequence and
        ``image_feature_index`` picks, for each local image token, its row of the features of
        all images. By default every CP rank encodes every image of the micro-batch; with
        ``vision_gather`` (index, width, group, rank; ``parallel.cp_split_vision``) it encodes only
        its own images and the features of all images are all-gathered."""
        emb, _ = self._embed(tokens, pixel_values, image_grid_thw, image_feature_index, vision_gather)
        return emb

    def _embed(self, tokens, pixel_values, image_grid_thw, image_feature_index=None, vision_gather=None):
        """``embed`` and the vision features of every image of the micro-batch (None without
        images), which the MTP embeddings reuse."""
        emb = self.language_model.embedding(input_ids=tokens, position_ids=None)  # [S, B, H]
        features = None
        if vision_gather is not None and self.vision_model is not None:
            # images split over CP ranks: every rank joins the all-gather, with or without images
            own = (self.vision_model(pixel_values, image_grid_thw).to(emb.dtype) if pixel_values.numel()
                   else emb.new_zeros(0, emb.shape[-1]))
            features = VisionGather.apply(own, *vision_gather)
            local = features.index_select(0, image_feature_index)
            emb = scatter_image_features(emb, vision_token_mask(tokens, self.image_token_id), local)
        elif pixel_values is not None and pixel_values.numel() and self.vision_model is not None:
            features = self.vision_model(pixel_values, image_grid_thw).to(emb.dtype)
            local = features if image_feature_index is None else features.index_select(0, image_feature_index)
            emb = scatter_image_features(emb, vision_token_mask(tokens, self.image_token_id), local)
        if self.config.sequence_parallel:
            emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
        return emb.contiguous(), features

    def _mtp_embeds(self, mtp: dict, features) -> list[torch.Tensor]:
        """Per MTP depth, the input embeddings [S, B, H] of the shifted tokens with the image
        features at image tokens, as vLLM's Qwen3_5MTP.embed_input_ids merges them."""
        out = []
        for k in range(mtp["tokens"].shape[0]):
            tokens = mtp["tokens"][k]
            emb = self.language_model.embedding(input_ids=tokens, position_ids=None)
            if features is not None and features.shape[0]:
                # the number of image tokens at this depth is the index's length, known on the host
                emb = scatter_image_features(emb, vision_token_mask(tokens, self.image_token_id),
                                             features.index_select(0, mtp["feature_index"][k]))
            if self.config.sequence_parallel:
                emb = tensor_parallel.scatter_to_sequence_parallel_region(emb)
            out.append(emb.contiguous())
        return out

    def forward(self, tokens, position_ids, labels=None, pixel_values=None, image_grid_thw=None,
                packed_seq_params=None, image_feature_index=None, padding_mask=None, vision_gather=None, mtp=None):
        """padding_mask [B, S] (True on padding) keeps padding out of MoE routing and its aux losses.
        ``mtp``: forward_step's shifted MTP inputs (models/common/mtp.py); the language model adds
        their loss in ``mtp["out"]``."""
        decoder_input = features = None
        if self.pre_process:
            decoder_input, features = self._embed(tokens, pixel_values, image_grid_thw, image_feature_index,
                                                  vision_gather)
        embeds = None
        if mtp is not None:
            embeds = self._mtp_embeds(mtp, features) if self.pre_process else self.received_mtp_embeds
            if embeds is None:
                raise RuntimeError("MTP: this pipeline stage received no MTP input embeddings; megatron's "
                                   "schedule must size its buffers by seq_length x stage_tokens_per_token")
        # read once by the language model's post-process (set every forward: none left from a failed one)
        self.language_model.mtp_batch = None if embeds is None or not self.post_process else {**mtp, "embeds": embeds}
        out = self.language_model(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=None,
            decoder_input=decoder_input,
            labels=labels,
            packed_seq_params=packed_seq_params,
            padding_mask=self._sequence_parallel_mask(padding_mask),
        )
        if embeds is not None and not self.post_process:  # the next stage gets them after the hidden states
            out = torch.cat([out, *embeds], dim=0)
        return out

    def build_schedule_plan(self, tokens, position_ids, **kwargs):
        """What megatron's combined-1F1B schedule runs instead of ``forward`` (parallel.moe_a2a_overlap):
        the same arguments, returned as a plan of per-layer nodes (models/common/schedule_plan.py)."""
        from models.common.schedule_plan import MultimodalSchedulePlan  # noqa: PLC0415

        return MultimodalSchedulePlan(self, tokens, position_ids, **kwargs)

    def _sequence_parallel_mask(self, padding_mask):
        # megatron scatters the mask itself only when it embeds the tokens; we pass decoder_input
        # (and middle pipeline stages embed nothing), so the mask follows the hidden states here
        if padding_mask is None or not self.config.sequence_parallel:
            return padding_mask
        return tensor_parallel.scatter_to_sequence_parallel_region(
            padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()

