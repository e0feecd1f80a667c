"""What a training run reports about itself, and nothing it computes with.

- ``metrics``: where the logged metrics go (console, metrics.jsonl, TensorBoard, W&B).
- ``step_clock``: the wall time of each log window, without a host sync.
- ``profiling``: the torch profiler over chosen steps, and the per-kernel summary of its trace.
- ``memory``: CUDA allocator history snapshots, manual garbage collection, activation bytes held.
- ``oom_advice``: the settings to change when a step runs out of GPU memory.

The training loop (multimodal/training.py) calls these; none of them changes what a step computes.
"""
