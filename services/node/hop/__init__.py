"""The mesh as a node sees it: signed routes, the next hop, the tracker, the relay.

May import engine, sampling and model; see ``services.node``'s map.
"""
