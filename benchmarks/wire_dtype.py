"""Does ``--wire-dtype int8`` change the answers? Greedy tokens with 8-bit activations on the wire, 50 prompts.

``python -m benchmarks.wire_dtype`` runs the default model in one process,
float32, greedy-decodes each of :data:`PROMPTS` exactly, then finds where the
same greedy decoding with the hidden states quantised and decoded
(:mod:`meshwire.q8`, exactly what a ``q8`` frame does) would first differ:
where a 2-node route's hop is (after the first half of the layers), and where
a 3-node route's two hops are. A forward hook on the last layer of each node
does it, on every position, as the wire would (blocks never straddle two
positions: 576 = 18 x 32). Greedy decoding follows the exact tokens until the
first position whose argmax differs, so one forward over the prompt and the
exact answer (teacher forcing) finds that position without decoding again.
It reports, per split, how many prompts' answers differ at all, the share of
generated tokens after a first difference, and the bytes a token costs on
each hop. Results go to ``results/wire_dtype.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import torch

from benchmarks.harness import DEFAULT_MODEL
from benchmarks.mesh import split_layers
from meshwire import q8

logger = logging.getLogger("benchmarks.wire_dtype")

TOPICS: Final = (
    "rivers", "volcanoes", "the moon", "bread", "bicycles", "libraries", "honey bees", "glaciers", "chess",
    "lighthouses", "trains", "coffee", "rainbows", "deserts", "owls", "the piano", "bridges", "tea", "comets",
    "forests", "the ocean tides", "clocks", "paper", "windmills", "penguins", "the printing press", "salt",
    "thunderstorms", "maps", "cheese", "the alphabet", "sailing", "caves", "gardens", "the telescope", "snow",
    "markets", "kites", "bamboo", "the violin", "deserts at night", "whales", "pottery", "the compass",
    "autumn leaves", "mountains", "candles", "the wheel", "castles", "fireflies",
)
PROMPTS: Final = tuple(f"Tell me three facts about {topic}." for topic in TOPICS)
MAX_NEW_TOKENS: Final = 32
RESULT: Final = Path(__file__).resolve().parent / "results" / "wire_dtype.json"


def quantising_hook(_module: torch.nn.Module, _args: object, output: object) -> object:
    """Replace a decoder layer's output hidden states by what a ``q8`` frame of them decodes to."""
    hidden = output[0] if isinstance(output, tuple) else output
    assert isinstance(hidden, torch.Tensor)
    decoded = q8.dequantize(q8.quantize(hidden), tuple(hidden.shape), hidden.dtype)
    return (decoded, *output[1:]) if isinstance(output, tuple) else decoded


def generate(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """Greedy tokens after ``ids`` (exact)."""
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
    return [int(t) for t in out[0, ids.shape[1]:]]


def agreeing_prefix(model: torch.nn.Module, ids: torch.Tensor, exact: Sequence[int], hops: Sequence[int]) -> int:
    """Tokens greedy decoding with ``q8`` after layers ``hops`` shares with ``exact`` before it first differs."""
    layers = model.model.layers
    handles = [layers[index].register_forward_hook(quantising_hook) for index in hops]
    try:
        with torch.inference_mode():
            full = torch.cat([ids, torch.tensor([list(exact)])], dim=1)
            logits = model(full).logits[0, ids.shape[1] - 1:-1]
    finally:
        for handle in handles:
            handle.remove()
    picks = logits.argmax(dim=-1).tolist()
    for position, (want, got) in enumerate(zip(exact, picks, strict=True)):
        if want != got:
            return position
    return len(exact)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wire_dtype", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(relativeCreated)8.0f ms] %(message)s")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.node.model.model_source import resolve_model

    folder = resolve_model(DEFAULT_MODEL).path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    splits = {f"{n} nodes": [end for _, end in split_layers(layers, n)[:-1]] for n in (2, 3)}
    report: dict[str, object] = {
        "model": DEFAULT_MODEL, "dtype": "float32", "max_new_tokens": MAX_NEW_TOKENS, "block": q8.BLOCK,
        "bytes_per_token": {"float32": hidden * 4, "bfloat16/float16": hidden * 2, "q8": q8.q8_nbytes(hidden)},
        "splits": {}}
    began = time.perf_counter()
    per_split: dict[str, dict[str, int]] = {name: {"prompts_differing": 0, "tokens": 0, "tokens_differing": 0}
                                            for name in splits}
    for index, prompt in enumerate(PROMPTS[:args.prompts]):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        exact = generate(model, ids)
        for name, hops in splits.items():
            same = agreeing_prefix(model, ids, exact, hops)
            tally = per_split[name]
            tally["tokens"] += len(exact)
            tally["tokens_differing"] += len(exact) - same
            tally["prompts_differing"] += int(same < len(exact))
        logger.info("prompt %d/%d done (%.0f s): %s", index + 1, args.prompts, time.perf_counter() - began,
                    {name: tally["prompts_differing"] for name, tally in per_split.items()})
        for name, tally in per_split.items():  # written after every prompt: an interrupted run keeps what it measured
            report["splits"][name] = {  # type: ignore[index]
                **tally, "hops": splits[name], "prompts": index + 1,
                "share_tokens_differing": round(tally["tokens_differing"] / max(tally["tokens"], 1), 4)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    logger.info("%s", json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
