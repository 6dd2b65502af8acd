"""What a structured output costs per token: the default model's decode with a JSON schema against without.

    .venv/bin/python -m benchmarks.structured                 # 5 rounds of 64 tokens each way
    .venv/bin/python -m benchmarks.structured --rounds 3 --tokens 32

writes ``benchmarks/results/structured.json`` and prints a summary. One
process, the default model (SmolLM2-135M-Instruct) in float32 with a KV cache,
two threads: each round decodes ``--tokens`` tokens greedily with the tail's
own :class:`~services.node.sampling.sampler.Sampler`, once free and once constrained
by the grammar the head compiles from :data:`SCHEMA` (llguidance's mask
computed and applied before the argmax, the grammar advanced after it). The
two ways alternate round by round, so a busy machine slows both alike. It
reports the median milliseconds per token of each, their difference, the
median time of the mask alone (compute + apply), measured inside the sampler,
and the median time of the tail's whole pick (bias, mask, choice, grammar
advance) each way: on a loaded machine the model's step varies by far more
than the grammar costs, so the pick times are the figure to read.
The constrained run is cut at ``--tokens`` like the free one, so both time
the same number of steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Final

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.harness import DEFAULT_MODEL
from benchmarks.machine import describe_machine
from benchmarks.results import RESULTS_DIR
from meshwire.sampling_params import SamplingParams
from services.node.head.tokens import eos_ids_of
from services.node.model.model_source import resolve_model
from services.node.sampling.grammar import Constraint, GrammarEngine, grammar_for_schema
from services.node.sampling.sampler import Sampler

logger = logging.getLogger("benchmarks.structured")

SCHEMA: Final = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["street", "city"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
"""A typical extraction schema: strings, an integer, a format, an array, a nested object."""
PROMPT: Final = [{"role": "user", "content": "Invent a person and describe them as JSON with name, age, email, "
                                             "tags and address."}]
THREADS: Final = 2


class TimedConstraint(Constraint):
    """A :class:`Constraint` that records how long each mask took."""

    def __init__(self, inner: Constraint) -> None:
        super().__init__(inner._matcher, inner._vocab_size)
        self.mask_s: list[float] = []

    def mask(self, scores: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        out = super().mask(scores)
        self.mask_s.append(time.perf_counter() - began)
        return out


@dataclass(frozen=True)
class Summary:
    tokens_per_round: int
    rounds: int
    free_ms_per_token: float
    constrained_ms_per_token: float
    extra_ms_per_token: float
    mask_ms_median: float
    pick_free_ms_median: float
    pick_constrained_ms_median: float
    mask_ms_p90: float
    constrained_text: str
    machine: dict[str, Any]


def decode(model: Any, prompt: torch.Tensor, tokens: int, sampler: Sampler,
           picks: list[float]) -> tuple[float, list[int]]:
    """Greedy decode ``tokens`` steps with ``sampler``; seconds per token and the ids (each pick's time to ``picks``)."""
    out: list[int] = []
    with torch.inference_mode():
        result = model(prompt, use_cache=True)
        began = time.perf_counter()
        for _ in range(tokens):
            picked = time.perf_counter()
            token = sampler.pick(result.logits[0, -1]).token
            picks.append(time.perf_counter() - picked)
            out.append(token)
            result = model(torch.tensor([[token]]), cache=result.past_key_values, use_cache=True)
        return (time.perf_counter() - began) / tokens, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(THREADS)
    path = resolve_model(DEFAULT_MODEL).path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = GrammarEngine(path, model.config.vocab_size, eos_ids_of(path, model.config))
    engine.prepare()
    grammar = grammar_for_schema(SCHEMA)
    engine.check(grammar)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    free: list[float] = []
    constrained: list[float] = []
    masks: list[float] = []
    free_picks: list[float] = []
    constrained_picks: list[float] = []
    text = ""
    for round_index in range(args.rounds):
        per_token, _ = decode(model, prompt, args.tokens, Sampler(SamplingParams(temperature=0.0)), free_picks)
        free.append(per_token)
        timed = TimedConstraint(engine.constraint(grammar))
        per_token, ids = decode(model, prompt, args.tokens,
                                Sampler(SamplingParams(temperature=0.0, grammar=grammar), timed), constrained_picks)
        constrained.append(per_token)
        masks.extend(timed.mask_s)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        logger.info("round %d: free %.2f ms/token, constrained %.2f ms/token", round_index,
                    free[-1] * 1e3, constrained[-1] * 1e3)
    masks.sort()
    summary = Summary(
        tokens_per_round=args.tokens, rounds=args.rounds,
        free_ms_per_token=statistics.median(free) * 1e3,
        constrained_ms_per_token=statistics.median(constrained) * 1e3,
        extra_ms_per_token=(statistics.median(constrained) - statistics.median(free)) * 1e3,
        mask_ms_median=statistics.median(masks) * 1e3,
        mask_ms_p90=masks[int(0.9 * (len(masks) - 1))] * 1e3,
        pick_free_ms_median=statistics.median(free_picks) * 1e3,
        pick_constrained_ms_median=statistics.median(constrained_picks) * 1e3,
        constrained_text=text,
        machine=describe_machine().model_dump(mode="json"),
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "structured.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    print(f"free {summary.free_ms_per_token:.2f} ms/token, with a schema {summary.constrained_ms_per_token:.2f} "
          f"ms/token ({summary.extra_ms_per_token:+.2f}); the mask alone {summary.mask_ms_median:.3f} ms median, "
          f"{summary.mask_ms_p90:.3f} ms p90; the tail's pick {summary.pick_free_ms_median:.3f} ms free, "
          f"{summary.pick_constrained_ms_median:.3f} ms constrained (medians)")
    print(f"constrained answer: {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
