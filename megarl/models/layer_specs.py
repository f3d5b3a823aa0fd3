"""The transformer layer implementations the model builder offers.

The config schema validates `model.layer_spec` against these (config imports models, never the
reverse); `megarl.models.builder.resolve_layer_spec` turns "auto" into one of the others.
"""

LAYER_SPECS = ("auto", "local", "transformer_engine")
"""auto: Transformer Engine where `megarl.device` says it is usable, megatron-core's local layers elsewhere."""
