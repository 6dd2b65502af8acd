"""Prefill/decode disaggregation: long prompts prefilled on prefill nodes, their KV pulled by decode nodes.

May import hop, engine, sampling and model; see ``services.node``'s map.
"""
