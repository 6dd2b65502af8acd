"""Single-process transformers: the yardstick the mesh is measured against.

:class:`SingleProcess` loads the whole model in this process in one number
format and times, with the same definitions as the mesh's stream
(:class:`~benchmarks.timing.StreamTiming`):

- :meth:`SingleProcess.generate`: greedy ``generate`` with its KV cache, what a
  user who does not run a mesh runs;
- :meth:`SingleProcess.recompute`: the earlier mesh's way, every new token
  re-runs the whole sequence through the model without a KV cache. Done here
  in one process with nothing on the wire and only the last position's logits,
  it is a lower bound of what the reference node server cost.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

from benchmarks.timing import StreamTiming

logger = logging.getLogger(__name__)

DTypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: Final[dict[DTypeName, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
WARMUP_TOKENS: Final = 4
"""Tokens generated once after loading, so the first timed run does not pay for kernel selection."""


class _TokenClock(BaseStreamer):
    """Notes when each generated token appears (``generate`` first hands the streamer the prompt)."""

    def __init__(self, began: float) -> None:
        self.began = began
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.began)

    def end(self) -> None:
        return None


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads, then restore the previous count."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class SingleProcess:
    """The whole model in this process, in one number format."""

    def __init__(self, folder: Path, dtype: DTypeName) -> None:
        began = time.perf_counter()
        self.dtype: DTypeName = dtype
        self.tokenizer: Any = AutoTokenizer.from_pretrained(folder)
        self.model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).eval()
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.generate([1, 2, 3], WARMUP_TOKENS)
        logger.info("single process %s: loaded %s and warmed up in %.1f s", dtype, folder.name,
                    time.perf_counter() - began)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, threads: int | None = None) -> StreamTiming:
        """Greedy ``generate`` with the KV cache, stopping at EOS or ``max_new_tokens``; when each token came.

        ``threads`` runs it with that many torch threads (``None``: torch's default, every core).
        """
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        clock = _TokenClock(time.perf_counter())
        with _torch_threads(threads), torch.inference_mode():
            clock.began = time.perf_counter()
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, streamer=clock, pad_token_id=self._pad_id)
        if not clock.times:
            raise RuntimeError("generate produced no token")
        return StreamTiming(tokens=len(clock.times), first_s=clock.times[0], last_s=clock.times[-1],
                            prompt_tokens=len(prompt_ids))

    def generate_batch(self, prompt_ids: Sequence[int], batch: int, max_new_tokens: int,
                       threads: int | None = None) -> float:
        """Aggregate tokens/s of greedy ``generate`` over a batch of ``batch`` copies of the prompt.

        What a single-process server batching its users would reach: every
        sequence makes ``max_new_tokens`` tokens (no EOS stop), timed over the
        whole call, prefill included.
        """
        ids = torch.tensor([list(prompt_ids)] * batch, dtype=torch.long)
        with _torch_threads(threads), torch.inference_mode():
            began = time.perf_counter()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self._pad_id)
            wall = time.perf_counter() - began
        return batch * (out.shape[1] - ids.shape[1]) / wall

    def recompute(self, prompt_ids: Sequence[int], new_tokens: int) -> list[float]:
        """Milliseconds of each of ``new_tokens`` greedy tokens made by re-running the whole sequence."""
        sequence = torch.tensor([list(prompt_ids)], dtype=torch.long)
        costs: list[float] = []
        with torch.inference_mode():
            for _ in range(new_tokens):
                began = time.perf_counter()
                logits = self.model(input_ids=sequence, use_cache=False, logits_to_keep=1).logits
                following = logits[:, -1].argmax(dim=-1, keepdim=True)
                sequence = torch.cat([sequence, following], dim=1)
                costs.append(1000.0 * (time.perf_counter() - began))
        return costs

    def close(self) -> None:
        """Free the model's memory now (a benchmark loads several in turn)."""
        del self.model
        gc.collect()
