"""Weights kept packed (int4/int8 from GGUF blocks) and the native kernels that multiply them (``kernels/``).

The lowest wing: imports nothing of the node but the leaves ``settings`` and ``metrics``.
"""
