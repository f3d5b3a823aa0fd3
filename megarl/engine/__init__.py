"""The Megatron training engine: forward-only scoring and forward-backward through the PP schedule."""
