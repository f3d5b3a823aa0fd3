"""megatron-core GPT models from HuggingFace configs: architectures, layer specs, value heads, HF <-> megatron state dicts."""
