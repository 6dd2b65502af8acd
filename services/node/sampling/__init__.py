"""Choosing the next token at the tail: the seeded sampler and the grammars that constrain it.

May import model; see ``services.node``'s map.
"""
