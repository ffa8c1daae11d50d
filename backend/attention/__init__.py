"""Attention: RoPE, MHA/MQA/GQA/MLA variants with their KV caches."""
