"""megatron's all-to-all token dispatcher, without host syncs where none is needed.

megatron-core 0.19's ``MoEAlltoAllTokenDispatcher`` already permutes with a fixed-size argsort
(tokens x top-k rows, no ``masked_select``), but it copies the token counts to the host for its
experts: ``SequentialMLP`` splits by them in Python, and the chunk sort after the all-to-all
takes host split sizes. With ``GroupedExperts`` the counts stay on the device, so:

- **one rank holds every expert** (EP = 1, expert TP = 1, no capacity / padding): the permuted
  tokens are already grouped by expert (the argsort runs over the expert-major routing map), the
  chunk sort and the all-to-all are identities. No device-to-host copy, no sync: the layer's
  shapes are fixed (tokens x top-k). The permutation's backward and the combine, megatron's
  atomic ``index_add`` / ``scatter_add`` over tokens x top-k rows, are gathers through the
  inverse permutation with an fp32 sum of each token's k rows: deterministic and rounded once.
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


class _GatherRows(torch.autograd.Function):
    """rows = tokens[token_of_row]: each token copied to its k expert rows. Backward sums a
    token's k row gradients through ``token_rows`` (its rows, token-major) with a gather and an
    fp32 sum instead of megatron's atomic ``index_add``: deterministic, and rounded once."""

    @staticmethod
    def forward(ctx, tokens, token_of_row, token_rows, k: int):
        ctx.save_for_backward(token_rows)
        ctx.k = k
        return tokens.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows):
        (token_rows,) = ctx.saved_tensors
        return _sum_rows(grad_rows, token_rows, ctx.k), None, None, None


class _SumRows(torch.autograd.Function):
    """out[t] = sum of token t's k expert rows (the combine), as a gather and an fp32 sum instead
    of megatron's atomic ``scatter_add``; backward hands every row its token's gradient."""

    @staticmethod
    def forward(ctx, rows, token_of_row, token_rows, k: int):
        ctx.save_for_backward(token_of_row)
        return _sum_rows(rows, token_rows, k)

    @staticmethod
    def backward(ctx, grad_out):
        (token_of_row,) = ctx.saved_tensors
        return grad_out.index_select(0, token_of_row), None, None, None


def _sum_rows(rows: torch.Tensor, token_rows: torch.Tensor, k: int) -> torch.Tensor:
    picked = rows.index_select(0, token_rows).view(-1, k, rows.shape[-1])
    return picked.sum(1, dtype=torch.float32).to(rows.dtype)


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

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if not self._all_local():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # megatron's bookkeeping, then the permutation as a gather with a known inverse
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden.view(self.hidden_shape))
        self.hidden_shape_before_permute = hidden.shape
        n_tokens, k = hidden.shape[0], self.config.moe_router_topk
        # rows grouped by expert, tokens ascending inside each (what megatron's argsort gives);
        # every token has exactly k rows (dropless top-k)
        order = routing_map.T.reshape(-1).argsort(descending=True, stable=True)[: n_tokens * k]
        token_of_row = order % n_tokens
        token_rows = token_of_row.argsort(stable=True)  # token t's rows: token_rows[t*k:(t+1)*k]
        self._rows = (token_of_row, token_rows, k)
        self.reversed_local_input_permutation_mapping = token_of_row
        rows = _GatherRows.apply(hidden, token_of_row, token_rows, k)
        return rows, probs.T.reshape(-1)[order]

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
        if self._all_local():
            token_of_row, token_rows, k = self._rows
            self._rows = None
            output = _SumRows.apply(permutated_local_input_tokens, token_of_row, token_rows, k)
            output = output.view(self.hidden_shape)
            if self.shared_experts is not None:
                output = output + self.shared_experts.get_output()
        else:
            output = super().combine_postprocess(permutated_local_input_tokens)
        # megatron keeps the router probabilities as an attribute after the layer is done. They
        # carry the autograd graph, whose gradient hooks (megatron DDP's) hold the model: a
        # reference cycle through C++ that Python's collector cannot see, so the model,
        # gradients and optimizer state of an MoE run would stay allocated after training
        # (docs/moe.md). Nothing reads them after the combine.
        self.probs = None
        return output
