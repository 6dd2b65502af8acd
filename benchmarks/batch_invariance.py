"""What riding in a batch does to a session's logits and greedy tokens, on the default model.

    .venv/bin/python -m benchmarks.batch_invariance                # float32, float16, bfloat16
    .venv/bin/python -m benchmarks.batch_invariance --dtypes float32 --steps 16

writes ``benchmarks/results/batch_invariance.json`` and prints one line per
format. The node runs a session's lone decode step on its exact single-session
path and the steps of sessions that are ready together as one batch
(:meth:`services.node.model.shard.Shard.run_rows`, at most ``--max-batch`` rows).
A B-row matrix product need not round like a 1-row one, so a row's logits may
depend on the batch it rode in. This measures by how much, with the node's own
code on the whole default model (30 layers, one shard):

* 20 chat prompts, each prefilled twice into two caches (identically: the same
  single-session path);
* greedy decoding of ``--steps`` tokens two ways: each session alone
  (``run_layers``, one row, as a lone request runs) and all 20 sessions
  together in batches of :data:`~services.node.settings.DEFAULT_MAX_BATCH`
  rows (16 + 4), as a busy node runs them;
* per prompt: the largest absolute difference of the float32 logits at the
  steps where both ways had produced the same tokens so far (the same
  inputs), and whether the greedy continuations differ anywhere.

No timing is measured; the figures are deterministic for a given CPU and
torch build (oneDNN picks kernels by instruction set).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

import torch

from benchmarks.harness import DEFAULT_MODEL
from benchmarks.results import RESULTS_DIR

logger = logging.getLogger("benchmarks.batch_invariance")

PROMPTS: Final[tuple[str, ...]] = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What does a thermometer measure?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List the days of the week.",
    "What is two plus two?",
    "Describe a cat in one sentence.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.",
    "What colour are bananas when ripe?",
    "Tell me a fun fact about octopuses.",
    "What is the largest planet in the solar system?",
    "How do plants make their food?",
    "Write one sentence about autumn leaves.",
)
DEFAULT_STEPS: Final = 32
DTYPES: Final = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
RESULT_FILE: Final = RESULTS_DIR / "batch_invariance.json"


@dataclass(frozen=True)
class FormatResult:
    """One number format's figures over the prompts."""

    dtype: str
    prompts: int
    steps: int
    batch_rows: tuple[int, ...]
    max_abs_logit_diff: float
    """Largest difference over every prompt and every step compared."""
    median_prompt_max_abs_logit_diff: float
    """The median over prompts of each prompt's largest difference."""
    prompts_with_different_greedy_tokens: int
    first_divergence_steps: tuple[int, ...]
    """For each prompt whose continuations differ: the step of the first different token."""


def measure(folder: Path, dtype: torch.dtype, steps: int, max_batch: int) -> FormatResult:
    """Greedy-decode every prompt alone and in batches through one whole-model shard; compare."""
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.prompts import prompt_token_ids
    from services.node.model.shard_load import load_shard

    config = AutoConfig.from_pretrained(folder)
    shard = load_shard(folder, 0, config.num_hidden_layers - 1, dtype, torch.device("cpu"))
    if not shard.batches_rows:
        raise SystemExit(f"{dtype}: this shard has no batched path; nothing to compare")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [prompt_token_ids(tokenizer, [{"role": "user", "content": text}]) for text in PROMPTS]
    alone_caches = [shard.new_cache() for _ in prompts]
    batch_caches = [shard.new_cache() for _ in prompts]
    alone_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    batch_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        for index, ids in enumerate(prompts):
            for cache in (alone_caches[index], batch_caches[index]):
                hidden = shard.run_layers(shard.embed(torch.tensor([ids])), cache, 0)
            first = shard.logits_last(hidden)
            alone_logits[index].append(first)
            batch_logits[index].append(first)
        for step in range(steps):
            logger.info("%s: step %d/%d", _name(dtype), step + 1, steps)
            for index, cache in enumerate(alone_caches):
                token = int(alone_logits[index][-1].argmax())
                hidden = shard.run_layers(shard.embed(torch.tensor([[token]])), cache, cache.seq_len)
                alone_logits[index].append(shard.logits_last(hidden))
            for begin in range(0, len(prompts), max_batch):
                group = range(begin, min(begin + max_batch, len(prompts)))
                tokens = [int(batch_logits[index][-1].argmax()) for index in group]
                states = shard.embed(torch.tensor([tokens])).transpose(0, 1)  # [rows, 1, hidden], as the engine
                caches = [batch_caches[index] for index in group]
                out = shard.run_rows(states, caches, [cache.seq_len for cache in caches], 0)
                for row, logits in zip(group, shard.logits_rows(out), strict=True):
                    batch_logits[row].append(logits)
    per_prompt_diff: list[float] = []
    divergences: list[int] = []
    for alone, batched in zip(alone_logits, batch_logits, strict=True):
        alone_tokens = [int(logits.argmax()) for logits in alone]
        batch_tokens = [int(logits.argmax()) for logits in batched]
        same_inputs = next((i for i, (a, b) in enumerate(zip(alone_tokens, batch_tokens, strict=True)) if a != b),
                           len(alone_tokens) - 1)
        # The logits of step i come from inputs made of tokens 0..i-1: equal inputs up to the first difference.
        per_prompt_diff.append(max(float((alone[i] - batched[i]).abs().max()) for i in range(same_inputs + 1)))
        if alone_tokens != batch_tokens:
            divergences.append(same_inputs)
    ordered = sorted(per_prompt_diff)
    return FormatResult(
        dtype=_name(dtype), prompts=len(prompts), steps=steps,
        batch_rows=tuple(min(max_batch, len(prompts) - begin) for begin in range(0, len(prompts), max_batch)),
        max_abs_logit_diff=max(per_prompt_diff), median_prompt_max_abs_logit_diff=ordered[len(ordered) // 2],
        prompts_with_different_greedy_tokens=len(divergences), first_divergence_steps=tuple(divergences),
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main(argv: list[str] | None = None) -> int:
    from services.node.model.model_source import resolve_model
    from services.node.settings import DEFAULT_MAX_BATCH

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated formats to measure")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="greedy tokens decoded per prompt")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="rows per batch, as a node's")
    parser.add_argument("--out", type=Path, default=RESULT_FILE)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s", stream=sys.stderr)
    folder = resolve_model(DEFAULT_MODEL).path
    results = []
    for name in args.dtypes.split(","):
        result = measure(folder, DTYPES[name.strip()], args.steps, args.max_batch)
        results.append(result)
        print(f"{result.dtype:9s} max |logit diff| {result.max_abs_logit_diff:.3g} "
              f"(median per prompt {result.median_prompt_max_abs_logit_diff:.3g}); greedy tokens differ on "
              f"{result.prompts_with_different_greedy_tokens}/{result.prompts} prompts over {result.steps} steps"
              + (f" (first at steps {list(result.first_divergence_steps)})" if result.first_divergence_steps else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": DEFAULT_MODEL, "threads": torch.get_num_threads(),
                                    "torch": torch.__version__, "results": [asdict(r) for r in results]},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
