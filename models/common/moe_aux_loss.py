"""Load-balancing aux loss under context / sequence parallelism with padding: scale by the mean
real-token count of the group, not by this rank's own.

megatron-core 0.19.2 (per-token-loss mode) multiplies each rank's aux loss by
``local_valid_tokens * tp_cp_size`` so that, after ``finalize_model_grads`` divides every
gradient by the global token count, the aux-loss gradient ends up scaled as in the mean-loss
mode. That cancellation assumes every rank of the TP x CP group holds the same number of valid
tokens. With padding excluded from routing (our ``padding_mask``) they do not: the zigzag CP
split gives the rank holding each sample's last chunk all of that sample's padding, so the
aux-loss gradient changed with the layout (measured: CP=2 vs CP=1 losses apart by 1.4e-3 after
three steps of the MoE proxy). Using the group mean, ``total_valid_tokens / group_size``, gives
the same total scaling as one rank holding everything, for any split of the padding, and equals
megatron's value whenever the ranks are balanced.
"""

from __future__ import annotations

import functools

from megatron.core.transformer.moe import router as _router

_original = _router.get_tokens_per_expert_and_token_count


@functools.wraps(_original)
def _with_group_mean_count(routing_map, reduce_group, topk=None, with_padding_mask=False):
    global_tokens_per_expert, local_num_tokens, total_num_tokens = _original(
        routing_map, reduce_group, topk=topk, with_padding_mask=with_padding_mask)
    if with_padding_mask:  # without a mask every rank has routing_map.shape[0] tokens: balanced
        local_num_tokens = total_num_tokens / reduce_group.size()
    return global_tokens_per_expert, local_num_tokens, total_num_tokens


def use_group_mean_token_count() -> None:
    """Idempotent; called when an MoE model is built."""
    _router.get_tokens_per_expert_and_token_count = _with_group_mean_count
