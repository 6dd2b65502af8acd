"""What batching buys a packed MoE shard held in transformers' own layers: decode rows and prompt chunks of
several sessions as one ragged step, against each session's step alone.

    PYTHONPATH=libs:. .venv/bin/python -m benchmarks.layer_rows [--layers 2] [--sessions 8] [--steps 8]
        [--runs 3] [--threads 2]

The shard is every layer of a synthetic GGUF of Qwen3-30B-A3B's layer shape (hidden 2048, 32 query and 4 KV
heads of 128, per-head q/k norms, 128 experts of 768, 8 routed a token; random Q4_0 blocks, written once by
:func:`benchmarks.gguf_shapes.write_shape`), held packed in its layers (:mod:`services.node.model.packed_layers`)
and run in this process through :class:`~services.node.model.shard.Shard`, as a node runs it. ``--sessions``
sessions of different prompt lengths (16, 23, 30, ... tokens) are prefilled, then, round by round
(:func:`benchmarks.rounds.interleave`):

* ``decode``: ``--steps`` decode steps of every session, each step taken both ways in turn (so the machine's
  drifting load weighs on both alike): one session's row at a time (``run_layers``), as a node that does not
  batch runs them, and all sessions' rows as one ragged step (``run_rows``);
* ``chunks``: a 32-token prompt chunk of every session, one at a time, then all as one ragged step.

Prints one JSON line: the median rows (or chunk tokens) a second of each, the median of each round's ratio
(batched over alone), whether every batched
row was bit for bit its session's step alone, and the other work on the machine during the run
(:class:`benchmarks.quiet.OtherWork`: above 0.25 cores the figures are a loaded machine's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Final

import torch

logger = logging.getLogger("benchmarks.layer_rows")

SHAPE: Final = "qwen3moe-30b-a3b"
FIRST_PROMPT: Final = 16
PROMPT_STEP: Final = 7
CHUNK: Final = 32


def _prompt(shard: object, index: int, length: int) -> torch.Tensor:
    vocab = shard.vocab_size  # type: ignore[attr-defined]
    return torch.tensor([[(97 * index + 13 * i + 5) % vocab for i in range(length)]])


def measure(layers: int, sessions: int, steps: int, runs: int, threads: int) -> dict[str, object]:
    from benchmarks.gguf_shapes import CACHE, SHAPES, write_shape
    from benchmarks.quiet import OtherWork
    from benchmarks.rounds import interleave
    from services.node.model.gguf_model import prepare_gguf_folder
    from services.node.model.quant.quant_load import resolve_format
    from services.node.model.shard_load import load_shard

    torch.set_num_threads(threads)
    path = write_shape(SHAPES[SHAPE], layers, CACHE)
    folder = prepare_gguf_folder(path, CACHE / "folders")
    fmt, _ = resolve_format("auto", path)
    shard = load_shard(folder, 0, layers - 1, torch.float32, torch.device("cpu"), fmt, path)
    assert shard.in_layers, "the synthetic MoE should be held packed in its layers"
    other = OtherWork.start()
    began = time.perf_counter()

    def prefilled() -> list[object]:
        caches = []
        for index in range(sessions):
            cache = shard.new_cache()
            shard.run_layers(shard.embed(_prompt(shard, index, FIRST_PROMPT + PROMPT_STEP * index)), cache, 0)
            caches.append(cache)
        return caches

    def decode() -> tuple[float, float]:
        """Rows a second alone and batched, the two ways taking turns step by step (so that the machine's load,
        which drifts, weighs on both alike), each on its own copy of the sessions."""
        alone, together = prefilled(), prefilled()
        tokens = [1 + index for index in range(sessions)]
        spent = [0.0, 0.0]
        for _ in range(steps):
            rows = shard.embed(torch.tensor([tokens])).transpose(0, 1)
            start = time.perf_counter()
            out = torch.cat([shard.run_layers(rows[i:i + 1], c, c.seq_len) for i, c in enumerate(alone)])
            spent[0] += time.perf_counter() - start
            start = time.perf_counter()
            shard.run_rows(rows, together, [c.seq_len for c in together], from_layer=0)
            spent[1] += time.perf_counter() - start
            tokens = [int(t) for t in shard.logits_rows(out).argmax(-1)]
        return sessions * steps / spent[0], sessions * steps / spent[1]

    def chunks() -> tuple[float, float]:
        """Chunk tokens a second alone and batched (one after the other, on copies of the sessions)."""
        alone, together = prefilled(), prefilled()
        parts = [_prompt(shard, 50 + index, CHUNK) for index in range(sessions)]
        start = time.perf_counter()
        for part, cache in zip(parts, alone, strict=True):
            shard.run_layers(shard.embed(part), cache, cache.seq_len)
        alone_s = time.perf_counter() - start
        start = time.perf_counter()
        shard.run_ragged(shard.embed(torch.cat(parts, 1)), together, [c.seq_len for c in together],
                         [CHUNK] * sessions, 0)
        return sessions * CHUNK / alone_s, sessions * CHUNK / (time.perf_counter() - start)

    # bit identity: the same first decode step both ways, from the same prefills
    first, second = prefilled(), prefilled()
    rows = shard.embed(torch.tensor([[1 + index for index in range(sessions)]])).transpose(0, 1)
    together = shard.run_rows(rows, first, [c.seq_len for c in first], from_layer=0)
    alone = torch.cat([shard.run_layers(rows[i:i + 1], c, c.seq_len) for i, c in enumerate(second)])
    identical = bool(torch.equal(together, alone))

    results = interleave({"decode": decode, "chunks": chunks}, runs, log=logger.info,
                         describe=lambda rates: f"alone {rates[0]:.1f}, batched {rates[1]:.1f} positions/s")
    medians = {f"{name} {way}": round(statistics.median(rates[index] for rates in results[name]), 1)
               for name in results for index, way in enumerate(("alone", "batched"))}
    ratios = {name: round(statistics.median(batched / alone for alone, batched in results[name]), 2)
              for name in results}
    return {
        "benchmark": "layer_rows", "shape": SHAPE, "layers": layers, "format": fmt, "sessions": sessions,
        "steps": steps, "runs": runs, "threads": threads,
        "decode_rows_per_s": {"alone": medians["decode alone"], "batched": medians["decode batched"]},
        "decode_ratio": ratios["decode"],
        "chunk_tokens_per_s": {"alone": medians["chunks alone"], "batched": medians["chunks batched"]},
        "chunk_ratio": ratios["chunks"],
        "batched_rows_bit_identical": identical,
        "other_cores": other.cores(), "seconds": round(time.perf_counter() - began, 1),
        "loadavg": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    print(json.dumps(measure(args.layers, args.sessions, args.steps, args.runs, args.threads)))


if __name__ == "__main__":
    main()
