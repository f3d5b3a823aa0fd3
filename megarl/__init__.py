"""megarl: Megatron-first RL post-training for LLMs."""
