"""Whether this node's hop output is batch-invariant: a row's hidden states the same bits alone or beside others.

A spot check (issue 37) compares a hop's receipt with its shadow's by the exact hash of their outputs. The two
replicas run the session's frames beside different company (each batches its own other sessions' rows), so
an exact comparison of hidden states is fair only where a row's result does not depend on the rows it rides
with. It does not through torch's dense float products (BLAS blocks and sums a B-row product differently for
each B: ``tests/test_batched_rows.py``), nor on a GPU; it does through meshnet's native quantized kernel on a
CPU, which computes every output of a row in one order whatever the batch (``tests/test_quant_kernel.py``,
``tests/test_q8_kernel.py``), with norms, rotary and attention computed per row or per session.

:func:`rows_exact_path` names that path when every product of the shard's layers takes it, or says ``None``.
The name carries what else decides the bits, so the tracker compares only nodes naming the same one:

* the rows the products take (``--activations``): ``int8`` rows give the same bits on every instruction set
  (integer sums); ``float32`` rows only on one (AVX-512 and AVX2 sum in other orders), and never where the
  CPU has AMX: there a product of 8 rows or more takes AMX and fewer take AVX-512, so a row's bits depend on
  its company (``kernels/quant_mm.cpp``, ``kAmxMinRows``);
* whether decode rows run as one native call per turn (``kernels/decode_rows.cpp``, AVX-512) or layer by
  layer through torch: the two round the norms differently;
* the KV cache's format (a 16-bit cache rounds keys and values).

Not invariant, so ``None``: float weights (torch's BLAS), a GPU, half-precision layers, layers the lean
decoder does not run (:mod:`services.node.model.packed_layers`), torch's int4 kernel (the native one not
built), and a node whose turn may hold more positions than the native kernel takes
(:data:`~services.node.model.quant.packed.NATIVE_MAX_ROWS`; larger products dequantize and go through BLAS).
"""

from __future__ import annotations

import logging
from typing import Final

import torch

from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import NATIVE_MAX_ROWS
from services.node.model.shard import Shard

logger = logging.getLogger(__name__)

AMX: Final = 4
"""The kernel's ``isa`` number for AMX (:data:`~services.node.model.quant.quant_kernel.ISA_NAMES`)."""
KV_NAMES: Final = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def rows_exact_path(shard: Shard, activations: str, max_turn_positions: int) -> str | None:
    """The name of the batch-invariant path every step of ``shard`` takes, or ``None`` where some step may not
    (module doc). ``max_turn_positions``: the most positions one of its turns may hold (prompt chunks and rows)."""
    why = _why_not(shard, activations, max_turn_positions)
    if why is not None:
        logger.info("hop output is not batch-invariant (a spot check compares this node only as a tail): %s", why)
        return None
    assert shard.lean is not None
    isa = int(torch.ops.meshnet_quant.best_isa())
    rows = "int8" if activations == "int8" else f"float32-{quant_kernel.ISA_NAMES[isa]}"
    decode = "native" if shard.lean.fused and quant_kernel.decode_rows_ready() else "torch"
    kv = _kv_dtype(shard)
    path = f"{rows}/{decode}/kv-{KV_NAMES.get(kv, str(kv))}"
    logger.info("hop output is batch-invariant on path %s: spot checks may compare it with a replica's", path)
    return path


def _kv_dtype(shard: Shard) -> torch.dtype:
    """The format the shard's KV cache keeps."""
    return shard.kv_dtype or shard.dtype


def _why_not(shard: Shard, activations: str, max_turn_positions: int) -> str | None:
    if shard.weights_format == "float":
        return "float weights: torch's BLAS rounds a row differently beside others"
    if shard.lean is None:
        return "its layers do not run through the lean decoder"
    if shard.device.type != "cpu":
        return f"it computes on {shard.device.type}"
    if shard.dtype != torch.float32:
        return f"its layers compute in {shard.dtype}"
    if not quant_kernel.available():
        return "meshnet's native kernel is not built (torch's int4 kernel)"
    if activations == "float32" and int(torch.ops.meshnet_quant.best_isa()) == AMX:
        return "float32 rows on a CPU with AMX: a product takes AMX from 8 rows, AVX-512 below"
    if max_turn_positions > NATIVE_MAX_ROWS:
        return (f"a turn may hold {max_turn_positions} positions, more than the native kernel's {NATIVE_MAX_ROWS} "
                "(a larger product goes through BLAS)")
    return None
