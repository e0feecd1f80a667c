"""Qwen3.5-VL (dense and MoE): hybrid Gated DeltaNet / gated attention decoder + ViT."""
