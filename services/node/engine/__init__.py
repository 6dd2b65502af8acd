"""The compute thread, the session table and the batched turns that run every session's step.

May import sampling and model; see ``services.node``'s map.
"""
