"""megatron-core GPT models from HuggingFace configs: architectures, layer specs, value heads, and the
HF <-> megatron state-dict adapters."""
