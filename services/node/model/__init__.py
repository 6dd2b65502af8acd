"""The layers themselves: finding the model, the shard, its KV cache and fused decode paths (torch lives here).

May import ``model.quant``; see ``services.node``'s map.
"""
