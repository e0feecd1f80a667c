"""The multimodal model as a megatron-core combined-1F1B schedule plan (``parallel.moe_a2a_overlap``).

With ``overlap_moe_expert_parallel_comm`` megatron's schedule (pipeline_parallel/combined_1f1b.py)
does not call the model: it calls ``forward_step_func(..., return_schedule_plan=True)``, which
must return a plan, and runs the forward of micro-batch i+1 interleaved with the backward of
micro-batch i layer by layer, so that one micro-batch's MoE dispatch / combine all-to-all (on a
communication stream) runs while the other computes (attention or experts).

Our plan is megatron's ``TransformerModelChunkSchedulePlan`` over the language model (a
GPTModel), with two of its pieces replaced:

- preprocess: the vision encoder and the scatter of image features into the token embeddings
  (``MultimodalModel.embed``: context-parallel feature index / gather and sequence-parallel
  scatter included) run eagerly inside megatron's pre-process node, followed by the language
  model's ``_preprocess`` (MRoPE angles, or position ids for the fused kernel). The backward of
  that node is the backward of the embedding and the vision encoder.
- layers: megatron's per-layer nodes (attention or Gated DeltaNet -> pre-MLP norm -> shared
  expert -> router -> dispatch preprocess | dispatch | experts | combine + residual) built by
  ``build_transformer_layer_callables``. It calls ``MoELayer.route`` without the padding mask
  that ``MoELayer.forward`` passes, so padding would be routed and counted by the load-balancing
  loss; our layer plan hands the chunk's padding mask to the router (see ``_route_with_mask``).

The postprocess is megatron's node calling the language model's ``_postprocess``: our output
layer / fused linear cross-entropy, exactly as in the plain forward. Everything a layer needs
from the micro-batch (rotary angles, ``packed_seq_params`` with THD / CP metadata, the padding
mask) travels in the plan's chunk state, which megatron's nodes hand to every layer.

Multi-token prediction (``model.mtp_num_layers``) runs where the plain forward runs it: inside
``_postprocess``, after the LM loss (models/common/language_model.py), so its MoE layer's
all-to-alls are not overlapped; megatron's own MTP layer nodes are not used (our MTP block is not
megatron's, see models/common/mtp.py). Its input embeddings are made in the pre-process node from
the token embedding and the vision features, and cross to the post-process node detached, like
every tensor between nodes: the post-process backward (and megatron's backward of the loss, which
reaches the MTP term) leaves their gradient on the detached copies, and the pre-process node's
backward sends it on into the embedding and the vision encoder with the decoder input's.
"""

from __future__ import annotations

import functools

from megatron.core.models.common.model_chunk_schedule_plan import (
    TransformerLayerSchedulePlan,
    TransformerModelChunkSchedulePlan,
)
from megatron.core.models.common.utils import PostProcessNode, PreProcessNode
from megatron.core.transformer.moe.moe_layer import MoELayer

from models.common.mtp import MTPBlock


class MultimodalPreProcessNode(PreProcessNode):
    """Vision encoder + embedding scatter (and the MTP input embeddings), then the language model's
    ``_preprocess``."""

    # (MTP embedding with its graph, the detached copy the post-process node used), for the backward
    mtp_embeds: list | None = None

    def forward_impl(self):
        state = self.chunk_state
        mm, inputs = state.multimodal, state.vision_inputs
        state.vision_inputs = None  # pixels are not needed once encoded (the graph keeps its own)
        if mm.pre_process:
            state.decoder_input, features = mm._embed(state.input_ids, **inputs)
            if state.mtp is not None:
                # detached at the node boundary; their .grad comes back in this node's backward
                self.mtp_embeds = [(e, e.detach().requires_grad_(e.requires_grad))
                                   for e in mm._mtp_embeds(state.mtp, features)]
                state.mtp_batch = {**state.mtp, "embeds": [d for _, d in self.mtp_embeds]}
        return super().forward_impl()

    def default_backward_func(self, outputs, output_grad):
        pairs = [(e, d.grad) for e, d in self.mtp_embeds or [] if d.grad is not None]
        self.mtp_embeds = None
        if pairs:
            outputs = (*outputs, *(e for e, _ in pairs))
            output_grad = (*output_grad, *(g for _, g in pairs))
        super().default_backward_func(outputs, output_grad)
        return output_grad


class MultimodalPostProcessNode(PostProcessNode):
    """megatron's post-process, with the micro-batch's MTP inputs handed to ``_postprocess`` (which
    runs the MTP depths after the LM loss, as in the plain forward)."""

    def forward_impl(self, hidden_states):
        batch = self.chunk_state.mtp_batch
        if batch is not None:
            # megatron's node passes no padding mask to _postprocess: the MTP layer's router needs it
            self.model.mtp_batch = {**batch, "padding_mask": self.chunk_state.padding_mask}
        return super().forward_impl(hidden_states)


def _route_with_mask(pre_dispatch, moe: MoELayer):
    """megatron's pre-dispatch callable, with the chunk's padding mask given to the router.

    ``MoELayer.forward`` passes ``padding_mask`` ([B, S], True on padding) transposed to the
    router; megatron's split callable calls ``moe.route(hidden)`` without it. For the duration of
    the call the instance's ``route`` is bound to the mask, so the rest of megatron's callable
    (norm, shared expert, dispatch preprocess, recompute / offload options) stays its own."""

    @functools.wraps(pre_dispatch)
    def run(node, hidden_states):
        mask = node.chunk_state.padding_mask
        if mask is None:
            return pre_dispatch(node, hidden_states)
        mask = mask.transpose(0, 1).bool()  # as MoELayer.forward: [B, S] -> [S, B]
        route = moe.route
        moe.route = lambda hidden, padding_mask=None: route(hidden, mask)
        try:
            return pre_dispatch(node, hidden_states)
        finally:
            del moe.route  # the class method again

    return run


class MultimodalLayerPlan(TransformerLayerSchedulePlan):
    """megatron's per-layer nodes; MoE layers route with the padding mask."""

    def _build_callable_nodes(self, event, comp_stream, comm_stream, extra_args):
        super()._build_callable_nodes(event, comp_stream, comm_stream, extra_args)
        if isinstance(self.layer.mlp, MoELayer):
            node = self.pre_dispatch_computation
            node.submodule = _route_with_mask(node.submodule, self.layer.mlp)


class MultimodalSchedulePlan(TransformerModelChunkSchedulePlan):
    """The plan of one micro-batch through ``MultimodalModel`` (arguments as its ``forward``)."""

    LAYER_SCHEDULE_PLAN_CLASS = MultimodalLayerPlan
    PRE_PROCESS_NODE_CLASS = MultimodalPreProcessNode
    POST_PROCESS_NODE_CLASS = MultimodalPostProcessNode

    def __init__(self, model, tokens, position_ids, labels=None, pixel_values=None, image_grid_thw=None,
                 packed_seq_params=None, image_feature_index=None, padding_mask=None, vision_gather=None,
                 mtp=None):
        lm = model.language_model
        if lm.mtp_process:
            raise NotImplementedError("megatron-core's own MTP block is not part of the multimodal schedule plan")
        # megatron's nodes read everything below from the chunk state; decoder_input is filled
        # by our pre-process node (the embedding needs the vision encoder's features)
        super().__init__(
            lm, tokens, position_ids, attention_mask=None, decoder_input=None, labels=labels,
            packed_seq_params=packed_seq_params, padding_mask=model._sequence_parallel_mask(padding_mask),
        )
        self.state.multimodal = model
        self.state.vision_inputs = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                        image_feature_index=image_feature_index, vision_gather=vision_gather)
        self.state.mtp = mtp  # forward_step's shifted MTP inputs; the pre-process node adds the embeddings
        self.state.mtp_batch = None

    def _build_layer_schedule_plan(self, module, comp_stream, comm_stream):
        if isinstance(module, MTPBlock):  # ours runs inside _postprocess (module docstring)
            return
        super()._build_layer_schedule_plan(module, comp_stream, comm_stream)

    def release_state(self):
        self.state.multimodal = None
        self.state.vision_inputs = None
        self.state.mtp = self.state.mtp_batch = None
        super().release_state()

    def node_names(self) -> list[list[str]]:
        """Per layer, the names of its real (not no-op) nodes in forward order (tests, logs)."""
        out = []
        for i in range(self.num_layers()):
            layer = self.get_layer(i)
            nodes = (layer.pre_dispatch_computation, layer.moe_dispatch, layer.mlp, layer.moe_combine,
                     layer.mtp_post_process)
            out.append([n.name for n in nodes if hasattr(n, "name")])
        return out

