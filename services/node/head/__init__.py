"""Hop 0 of a route: a prompt in, a stream of text out (generation, tokens, stops, failover, speculation).

May import pd, hop, engine, sampling and model; see ``services.node``'s map.
"""
