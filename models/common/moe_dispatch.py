"""megatron's all-to-all token dispatcher, without host syncs where none is needed.

megatron-core 0.19's ``MoEAlltoAllTokenDispatcher`` already permutes with a fixed-size argsort
(tokens x top-k rows, no ``masked_select``), but it copies the token counts to the host for its
experts: ``SequentialMLP`` splits by them in Python, and the chunk sort after the all-to-all
takes host split sizes. With ``GroupedExperts`` the counts stay on the device, so:

- **one rank holds every expert** (EP = 1, expert TP = 1, no capacity / padding): the permuted
  tokens are already grouped by expert (the argsort runs over the expert-major routing map), the
  chunk sort and the all-to-all are identities. No device-to-host copy, no sync: the layer's
  shapes are fixed (tokens x top-k), which also lets it run under CUDA graphs.
- **EP > 1 or expert TP > 1**: the all-to-all needs its split sizes on the host; megatron copies
  them once per layer on a side stream and waits once, before the dispatch all-to-all. That one
  sync per layer stays (the collective's sizes must be known to launch it); the experts still
  take the counts from the device tensor computed before the copy.

It also drops megatron's reference to the router probabilities once a layer has combined (see
``combine_postprocess``), which kept a finished MoE run's memory allocated.

Use: ``GroupedDispatcher.adopt(moe_layer)`` after the model is built (the class only overrides
methods, so the dispatcher megatron built keeps its state).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class GroupedDispatcher(MoEAlltoAllTokenDispatcher):
    """See the module docstring."""

    _device_counts: torch.Tensor | None = None

    @classmethod
    def adopt(cls, moe_layer) -> bool:
        """Switch ``moe_layer``'s all-to-all dispatcher to this class; False for other dispatchers."""
        dispatcher = moe_layer.token_dispatcher
        if type(dispatcher) is not MoEAlltoAllTokenDispatcher:
            return False
        dispatcher.__class__ = cls
        return True

    def _all_local(self) -> bool:
        c = self.config
        return (self.ep_size == 1 and self.tp_size == 1 and not self.drop_and_pad
                and c.moe_expert_capacity_factor is None and not c.moe_router_padding_for_quantization)

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        counts = super().preprocess(routing_map)  # per local expert, on the device
        if self._all_local():
            self.cuda_sync_point = "no_sync"  # megatron asks for one only to give the counts to the host
        self._device_counts = counts
        return counts

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if self._all_local():
            return tokens_per_expert
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        counts, self._device_counts = self._device_counts, None
        if self._all_local():
            self.tokens_per_expert = None
            return global_input_tokens, counts, global_probs
        tokens, _, probs = super().dispatch_postprocess(global_input_tokens, global_probs)
        return tokens, counts, probs

    def combine_preprocess(self, hidden_states):
        if self._all_local():
            return hidden_states  # no chunk sort to undo, no expert-TP reduce-scatter
        return super().combine_preprocess(hidden_states)

    def combine_postprocess(self, permutated_local_input_tokens):
        output = super().combine_postprocess(permutated_local_input_tokens)
        # megatron keeps the router probabilities as an attribute after the layer is done. They
        # carry the autograd graph, whose gradient hooks (megatron DDP's) hold the model: a
        # reference cycle through C++ that Python's collector cannot see, so the model,
        # gradients and optimizer state of an MoE run stayed allocated after training (81 GiB
        # on the 35B-A3B slice). Nothing reads them after the combine.
        self.probs = None
        return output
