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
"""

from __future__ import annotations

import functools

from megatron.core.models.common.model_chunk_schedule_plan import (
    TransformerLayerSchedulePlan,
    TransformerModelChunkSchedulePlan,
)
from megatron.core.models.common.utils import PreProcessNode
from megatron.core.transformer.moe.moe_layer import MoELayer


class MultimodalPreProcessNode(PreProcessNode):
    """Vision encoder + embedding scatter, then the language model's ``_preprocess``."""

    def forward_impl(self):
        state = self.chunk_state
        mm, inputs = state.multimodal, state.vision_inputs
        state.vision_inputs = None  # pixels are not needed once encoded (the graph keeps its own)
        if mm.pre_process:
            state.decoder_input = mm.embed(state.input_ids, **inputs)
        return super().forward_impl()


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

    def __init__(self, model, tokens, position_ids, labels=None, pixel_values=None, image_grid_thw=None,
                 packed_seq_params=None, image_feature_index=None, padding_mask=None, vision_gather=None):
        lm = model.language_model
        if lm.mtp_process or getattr(lm, "mtp", None) is not None:
            raise NotImplementedError("multi-token prediction is not wired into the multimodal schedule plan")
        # megatron's nodes read everything below from the chunk state; decoder_input is filled
        # by our pre-process node (the embedding needs the vision encoder's features)
        super().__init__(
            lm, tokens, position_ids, attention_mask=None, decoder_input=None, labels=labels,
            packed_seq_params=packed_seq_params, padding_mask=model._sequence_parallel_mask(padding_mask),
        )
        self.state.multimodal = model
        self.state.vision_inputs = dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                        image_feature_index=image_feature_index, vision_gather=vision_gather)

    def release_state(self):
        self.state.multimodal = None
        self.state.vision_inputs = None
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

