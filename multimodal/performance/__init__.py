"""Trainer-level speed and memory machinery, applied to a built model and its optimizer.

- ``multi_tensor``: torch ``_foreach`` kernels in place of megatron's Python loops, fused AdamW,
  and the 1/tokens and clip scales deferred into the AdamW kernel.
- ``flat_adamw_patch``: one AdamW kernel over flat buffers (``optimizer.flat``).
- ``overlap_update``: each piece's update run as the next forward reaches it (``optimizer.overlap_step``).
- ``recompute``: selective activation recompute (``train.recompute_modules``), memory for time.

The optimizer patches are applied, in the order they need, by multimodal/optimizer.py only.
Why apart from models/performance/: these patch megatron's optimizer and DDP, which belong to
the trainer (multimodal/); nothing below the trainer imports them (tests/test_layering.py).
"""
