"""Quantized products: torch's int4 kernel (``aten``) against meshnet's native one, per matrix and per step.

    PYTHONPATH=libs:. .venv/bin/python -m benchmarks.kernels [--reps 30] [--threads 1 2] [--no-step|--no-matrices]

Prints two tables (milliseconds, the fastest of ``--reps`` runs, each old run
beside its new one, interleaved, in one process):

* per matrix: the default model's shapes (fused q/k/v 576 -> 960, o 576 ->
  576, fused gate/up 576 -> 3072, down 1536 -> 576 in int4; the LM head
  576 -> 49152 in int8), random weights, at 1, 4, 8 and 16 rows, and beside
  them what the dequantized product (:meth:`QuantMatrix.dequantize` and a
  float32 product, what a long prompt chunk does) costs at 64..512 rows, to
  place :data:`services.node.model.quant.packed.NATIVE_MAX_ROWS`;
* per decode step: the default model's GGUF as one int4 shard (30 layers and
  the LM head, ``Shard.run_rows`` and ``logits_rows``) for 1 and 8 sessions
  each with a 32-token prompt cached, loaded once per layout;
* per GGUF type (``--formats``): each type served packed (Q4_0, Q4_1, Q5_0,
  Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; valid random blocks) on the native kernel at
  decode rows (1 and 8), interleaved in one run, as a ratio to Q4_1, for a
  matrix of the default model's ``down`` shape (576 x 1536, K-quants need 256 |
  inputs) and one of Llama-3.1-8B's ``o`` (4096 x 4096, beyond the caches); and
  with ``--files`` the whole decode step of the default model from its Q4_1
  file against the same model requantized to Q4_K_M (``benchmarks.loglik``
  makes that file);
* ``--activations``: float32 rows against int8 rows (``--activations``), per
  matrix at 1-256 rows, and the int4 shard's decode step (1, 8, 16 sessions)
  and a 256-token prompt chunk.

The fastest run is the figure: the machine is shared, and load from elsewhere only adds time.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final
from unittest import mock

import torch

from services.node.model.model_source import resolve_model
from services.node.model.quant import quant_kernel
from services.node.model.quant.packed import QUANTIZED_DTYPE, QuantMatrix, groups_of
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard

logger = logging.getLogger(__name__)

SHAPES: Final = (("qkv 960x576", 960, 576, "int4"), ("o 576x576", 576, 576, "int4"),
                 ("gate_up 3072x576", 3072, 576, "int4"), ("down 576x1536", 576, 1536, "int4"),
                 ("lm_head 49152x576", 49152, 576, "int8"))
ROWS: Final = (1, 4, 8, 16)
LARGE_ROWS: Final = (64, 128, 256, 512)
STEP_ROWS: Final = (1, 8)
PROMPT_TOKENS: Final = 32


def fastest(runs: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """The fastest time of each of ``runs`` in ms, the runs interleaved rep by rep (after one warm-up each)."""
    best = [float("inf")] * len(runs)
    for run in runs:
        run()
    for _ in range(reps):
        for index, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[index] = min(best[index], (time.perf_counter() - started) * 1e3)
    return best


def matrices(reps: int, threads: Sequence[int]) -> None:
    print(f"{'matrix':<20} {'thr':>3} {'rows':>4} {'aten ms':>9} {'native ms':>9} {'speed-up':>8}")
    for name, out_features, in_features, fmt in SHAPES:
        groups = groups_of(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)),
                           fmt)  # type: ignore[arg-type]
        old, new = QuantMatrix(groups, "aten"), QuantMatrix(groups, "native")
        del groups
        for count in threads:
            torch.set_num_threads(count)
            for rows in ROWS:
                x = torch.randn(rows, in_features)
                a, b = fastest([lambda x=x, m=old: m.matmul(x), lambda x=x, m=new: m.matmul(x)], reps)
                print(f"{name:<20} {count:>3} {rows:>4} {a:>9.3f} {b:>9.3f} {a / b:>7.1f}x")
            for rows in LARGE_ROWS:
                x = torch.randn(rows, in_features)
                kernel, dequantized = fastest(
                    [lambda x=x, m=new: quant_kernel.mm(x, m.packed, m.scale_zeros, m.bits),
                     lambda x=x, m=new: torch.nn.functional.linear(x, m.dequantize(torch.float32))],
                    max(3, reps // 5))
                print(f"{name:<20} {count:>3} {rows:>4}  native {kernel:.2f} ms, dequantized+float32 "
                      f"{dequantized:.2f} ms")


FORMAT_SHAPES: Final = (("down 576x1536", 576, 1536), ("8B o 4096x4096", 4096, 4096))
FORMAT_ROWS: Final = (1, 8)


def formats(reps: int, threads: Sequence[int]) -> None:
    """Each GGUF type's packed product against Q4_1's, interleaved in one run (module doc)."""
    import numpy as np

    from services.node.model.quant.packed import GGUF_BLOCK_BYTES, GGUF_BLOCK_WEIGHTS, gguf_groups

    kinds = ("Q4_1", "Q4_0", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
    print(f"\n{'matrix':<16} {'thr':>3} {'rows':>4} " + " ".join(f"{k:>13}" for k in kinds))
    rng = np.random.default_rng(0)
    for name, out_features, in_features in FORMAT_SHAPES:
        matrices = []
        for kind in kinds:
            raw = rng.integers(0, 256, (out_features * in_features // GGUF_BLOCK_WEIGHTS[kind], GGUF_BLOCK_BYTES[kind]),
                               dtype=np.uint8)
            at = 208 if kind == "Q6_K" else 0  # finite scales (the rest of a block is any bytes)
            raw[:, at:at + 2] = np.full(len(raw), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
            matrices.append(QuantMatrix(gguf_groups(kind, raw, out_features, in_features), "native"))
        for count in threads:
            torch.set_num_threads(count)
            for rows in FORMAT_ROWS:
                x = torch.randn(rows, in_features)
                times = fastest([lambda x=x, m=m: quant_kernel.mm(x, m.packed, m.scale_zeros, m.bits)
                                 for m in matrices], reps)
                cells = " ".join(f"{t:>6.3f} {t / times[0]:>5.2f}x" for t in times)
                print(f"{name:<16} {count:>3} {rows:>4} {cells}")
    print("(each cell: ms, then the ratio to Q4_1's time)")


def file_steps(reps: int, threads: Sequence[int]) -> None:
    """The default model's whole decode step from its Q4_1 file and from the Q4_K_M one (module doc)."""
    from benchmarks.loglik import CACHE, Q4_K_M_NAME
    from services.node.model.quant.quant_load import resolve_format

    model = resolve_model("default")
    cpu = torch.device("cpu")
    files = [model.gguf, CACHE / Q4_K_M_NAME]
    if not files[1].exists():
        print(f"\n{files[1]} is missing: run benchmarks.loglik first")
        return
    shards = [load_shard(model.path, 0, 29, QUANTIZED_DTYPE, cpu, resolve_format("auto", f)[0], f) for f in files]
    print(f"\n{'decode step (30 layers + LM head)':<36} {'thr':>3} {'rows':>4} {'Q4_1 ms':>9} {'Q4_K_M ms':>9} "
          f"{'ratio':>6}  (weight MB {shards[0].weight_bytes() / 1e6:.1f} / {shards[1].weight_bytes() / 1e6:.1f})")
    prompt = torch.arange(100, 100 + PROMPT_TOKENS).unsqueeze(0)
    for count in threads:
        torch.set_num_threads(count)
        for rows in STEP_ROWS:
            a, b = fastest([_decode_step(shard, rows, prompt) for shard in shards], reps)
            print(f"{'default model':<36} {count:>3} {rows:>4} {a:>9.2f} {b:>9.2f} {b / a:>5.2f}x")


def _decode_step(shard: Shard, rows: int, prompt: torch.Tensor) -> Callable[[], None]:
    """One decode step of ``rows`` sessions that each hold ``prompt``, through ``shard`` and its LM head; each
    call leaves the caches as it found them."""
    caches = [shard.new_cache() for _ in range(rows)]
    for cache in caches:
        shard.run_layers(shard.embed(prompt), cache, 0)
    hidden = shard.embed(torch.full((1, rows), 42)).view(rows, 1, -1)

    def step() -> None:
        out = shard.run_rows(hidden, caches, [PROMPT_TOKENS] * len(caches), 0)
        shard.logits_rows(out)
        for cache in caches:
            cache.truncate(PROMPT_TOKENS)
    return step


def steps(reps: int, threads: Sequence[int]) -> None:
    model = resolve_model("default")
    cpu = torch.device("cpu")
    with mock.patch.object(quant_kernel, "available", return_value=False):
        old = load_shard(model.path, 0, 29, QUANTIZED_DTYPE, cpu, "int4", model.gguf)
    new = load_shard(model.path, 0, 29, QUANTIZED_DTYPE, cpu, "int4", model.gguf)
    print(f"\n{'decode step (30 layers + LM head)':<36} {'thr':>3} {'rows':>4} {'aten ms':>9} {'native ms':>9} "
          f"{'speed-up':>8}")
    prompt = torch.arange(100, 100 + PROMPT_TOKENS).unsqueeze(0)
    for count in threads:
        torch.set_num_threads(count)
        for rows in STEP_ROWS:
            a, b = fastest([_decode_step(shard, rows, prompt) for shard in (old, new)], reps)
            print(f"{'int4 shard 0-29':<36} {count:>3} {rows:>4} {a:>9.2f} {b:>9.2f} {a / b:>7.1f}x")


ACTIVATION_ROWS: Final = (1, 8, 16, 64, 256)
ACTIVATION_STEP_ROWS: Final = (1, 8, 16)
PROMPT_CHUNK: Final = 256


def _with_activations(mode: str, run: Callable[[], object]) -> Callable[[], object]:
    """``run`` with the process's quantized products taking ``mode`` rows (restored to float32 after)."""
    def timed() -> object:
        quant_kernel.choose_activations(mode)
        try:
            return run()
        finally:
            quant_kernel.choose_activations("float32")
    return timed


def activations(reps: int, threads: Sequence[int]) -> None:
    """float32 rows against int8 rows (``--activations``, issue 38), interleaved: each int4 matrix of the default
    model's shapes and the int8 LM head at decode and prompt rows, then the whole int4 shard's decode step and a
    prompt chunk of :data:`PROMPT_CHUNK` tokens."""
    logging.getLogger(quant_kernel.__name__).setLevel(logging.WARNING)  # one line per switch otherwise
    print(f"\n{'matrix':<20} {'thr':>3} {'rows':>4} {'float32 ms':>10} {'int8 ms':>9} {'speed-up':>8}")
    for name, out_features, in_features, fmt in SHAPES:
        groups = groups_of(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)),
                           fmt)  # type: ignore[arg-type]
        matrix = QuantMatrix(groups, "native")
        for count in threads:
            torch.set_num_threads(count)
            for rows in ACTIVATION_ROWS:
                x = torch.randn(rows, in_features)
                a, b = fastest([lambda x=x, m=matrix: torch.ops.meshnet_quant.mm(x, m.packed, m.scale_zeros, m.bits,
                                                                                 0, 0),
                                lambda x=x, m=matrix: quant_kernel.mm8(x, m.packed, m.scale_zeros, m.bits)],
                               reps if rows <= 16 else max(3, reps // 5))
                print(f"{name:<20} {count:>3} {rows:>4} {a:>10.3f} {b:>9.3f} {a / b:>7.2f}x")
    model = resolve_model("default")
    shard = load_shard(model.path, 0, 29, QUANTIZED_DTYPE, torch.device("cpu"), "int4", model.gguf)
    print(f"\n{'int4 shard 0-29 (+ LM head)':<36} {'thr':>3} {'rows':>4} {'float32 ms':>10} {'int8 ms':>9} "
          f"{'speed-up':>8}")
    prompt = torch.arange(100, 100 + PROMPT_TOKENS).unsqueeze(0)
    chunk = torch.arange(100, 100 + PROMPT_CHUNK).unsqueeze(0)

    def prefill() -> None:
        shard.run_layers(shard.embed(chunk), shard.new_cache(), 0)
    for count in threads:
        torch.set_num_threads(count)
        for rows in ACTIVATION_STEP_ROWS:
            step = _decode_step(shard, rows, prompt)
            a, b = fastest([_with_activations("float32", step), _with_activations("int8", step)], reps)
            print(f"{'decode step':<36} {count:>3} {rows:>4} {a:>10.2f} {b:>9.2f} {a / b:>7.2f}x")
        a, b = fastest([_with_activations("float32", prefill), _with_activations("int8", prefill)], max(3, reps // 5))
        print(f"{f'prompt chunk of {PROMPT_CHUNK} tokens':<36} {count:>3} {PROMPT_CHUNK:>4} {a:>10.2f} {b:>9.2f} "
              f"{a / b:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-step", action="store_true", help="skip the whole-shard decode step")
    parser.add_argument("--no-matrices", action="store_true", help="skip the per-matrix table")
    parser.add_argument("--formats", action="store_true", help="only each GGUF type against Q4_1 (module doc)")
    parser.add_argument("--files", action="store_true", help="with --formats: the Q4_1 and Q4_K_M files' steps")
    parser.add_argument("--activations", action="store_true",
                        help="only float32 rows against int8 rows (--activations, issue 38)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not quant_kernel.available():
        raise SystemExit("the native kernel is not available (see the log above)")
    with torch.inference_mode():
        if args.activations:
            activations(args.reps, args.threads)
            return
        if args.formats:
            formats(args.reps, args.threads)
            if args.files:
                file_steps(args.reps, args.threads)
            return
        if not args.no_matrices:
            matrices(args.reps, args.threads)
        if not args.no_step:
            steps(args.reps, args.threads)


if __name__ == "__main__":
    main()
