"""A tiny dense vision-language model: plain causal attention with 1-D rotary, a SwiGLU MLP, and
the simplest vision path (a linear patch embedding and a merger, no ViT blocks). It exists to
show that an architecture is a folder plus one registry line: it has no GDN, no MRoPE, no MoE
and no Hugging Face counterpart, and trains through the same trainer (tests/test_training.py)."""
