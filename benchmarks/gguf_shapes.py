"""Real models' layer shapes from synthetic GGUFs: decode of 1 and 2 nodes against llama.cpp, MoE included.

    PYTHONPATH=libs:. .venv/bin/python -m benchmarks.gguf_shapes [--shapes llama-8b qwen3moe-30b-a3b]
        [--layers 4] [--tokens 32] [--runs 3] [--threads 2]

A shape's file is written here once (``~/.cache/meshnet/bench/<shape>-<layers>L-Q4_0.gguf``): the layer shape
of a real model with random Q4_0 blocks (every matrix of its layers; the embedding and output in Q8_0, norms
and MoE routers in F32, as llama.cpp writes them), fewer layers so that it fits beside the others on a shared
machine, and the test suite's tiny vocabulary (the LM head is not what is measured). The output rows of the
end-of-text tokens have a zero scale, so greedy decoding of the random model never stops early. Blocks are
random bytes with a scale that gives each weight a standard deviation of about ``1/sqrt(inputs)``: the
arithmetic is a real model's, only the values are not.

* ``llama-8b``: Llama-3.1-8B's layer (hidden 4096, 32 query and 8 KV heads of 128, MLP 14336): the lean
  decoder's path (:mod:`services.node.model.lean_decode`);
* ``qwen3moe-30b-a3b``: Qwen3-30B-A3B's layer (hidden 2048, 32 query and 4 KV heads of 128, per-head q/k norms,
  128 experts of 768, 8 routed a token): the packed-in-place path (:mod:`services.node.model.packed_layers`).

Each contender decodes ``--tokens`` greedy tokens after the same short prompt, ``--runs`` times round by round
(:func:`benchmarks.rounds.interleave`): llama.cpp in this process (its AMX repack off, as
:mod:`benchmarks.llama_cpp` loads it), a mesh of 1 node and one of 2 (tracker and node processes,
:mod:`benchmarks.mesh`). Prints one JSON line per shape: median decode tok/s of each, the ratios, each node's
RSS and load time, and the load average before and after (other engineers share the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

logger = logging.getLogger(__name__)

CACHE: Final = Path("~/.cache/meshnet/bench").expanduser()
Q4_0_BLOCK: Final = 32
Q4_0_BYTES: Final = 18
Q8_0_BYTES: Final = 34
NIBBLE_STD: Final = 4.6
"""Standard deviation of a uniform nibble minus 8: a block's scale is ``1 / (NIBBLE_STD sqrt(inputs))``."""
ROUTER_STD: Final = 0.02
SEED: Final = 0
PROMPT: Final = ({"role": "user", "content": "Tell me a long story about the river."},)


@dataclass(frozen=True)
class Shape:
    """One real model's layer shape (``experts`` 0: a dense layer)."""

    name: str
    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    experts: int = 0
    used: int = 0

    @property
    def moe(self) -> bool:
        return self.experts > 0


SHAPES: Final = {
    "llama-8b": Shape("llama-8b", "llama", hidden=4096, heads=32, kv_heads=8, head_dim=128, inner=14336),
    "qwen3moe-30b-a3b": Shape("qwen3moe-30b-a3b", "qwen3moe", hidden=2048, heads=32, kv_heads=4, head_dim=128,
                              inner=768, experts=128, used=8),
}


def _q4_0(rng: np.random.Generator, leading: tuple[int, ...], cols: int) -> np.ndarray:
    """Random Q4_0 blocks of a ``leading + (cols,)`` tensor, as GGUF bytes ``leading + (bytes a row,)``."""
    rows = int(np.prod(leading))
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    scale = np.float16(1.0 / (NIBBLE_STD * np.sqrt(cols)))
    blocks[..., :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return blocks.reshape(*leading, -1)


def _q8_0(rng: np.random.Generator, rows: int, cols: int, silent: tuple[int, ...] = ()) -> np.ndarray:
    """Random Q8_0 blocks of a ``rows x cols`` matrix; rows ``silent`` get a zero scale (all zero)."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q8_0_BYTES), dtype=np.uint8)
    scale = np.float16(1.0 / (70.0 * np.sqrt(cols)))
    blocks[..., :2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    for row in silent:
        blocks[row, :, :2] = 0
    return blocks.reshape(rows, -1)


def add_hyper_parameters(writer: Any, shape: Shape, *, layers: int, context: int, vocab: int, rope_base: float,
                         rms_eps: float) -> None:
    """Write ``shape``'s hyper-parameters into a GGUF ``writer`` (a ``gguf.GGUFWriter``), with what the file
    itself decides: its layer count, context, vocabulary, rope base and norm epsilon. Shared with
    :mod:`benchmarks.synthetic_gguf`, whose whole-model files carry the same keys in the same order."""
    writer.add_context_length(context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(shape.inner)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(rms_eps)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_vocab_size(vocab)
    writer.add_rope_freq_base(rope_base)
    if shape.arch == "llama":
        writer.add_rope_dimension_count(shape.head_dim)
    if shape.moe:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.used)
        writer.add_expert_feed_forward_length(shape.inner)

def write_shape(shape: Shape, layers: int, dest: Path) -> Path:
    """``shape``'s synthetic GGUF of ``layers`` layers (module doc), written once."""
    import gguf

    from tests.gguf_models import _write_tokenizer
    from tests.tiny_model import END_OF_TEXT, IM_END, _build_tokenizer

    path = dest / f"{shape.name}-{layers}L-Q4_0.gguf"
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    vocab = len(tokenizer)
    rng = np.random.default_rng(SEED)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    writer.add_name(f"synthetic {shape.name}")
    add_hyper_parameters(writer, shape, layers=layers, context=4096, vocab=vocab, rope_base=500_000.0, rms_eps=1e-6)
    _write_tokenizer(writer, tokenizer)
    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0
    ones = np.ones(shape.hidden, dtype=np.float32)

    def add(name: str, blocks: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    silent = tuple(tokenizer.convert_tokens_to_ids(token) for token in (IM_END, END_OF_TEXT))
    add("token_embd.weight", _q8_0(rng, vocab, shape.hidden), q8)
    writer.add_tensor("output_norm.weight", ones)
    add("output.weight", _q8_0(rng, vocab, shape.hidden, silent), q8)
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for layer in range(layers):
        blk = f"blk.{layer}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones)
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones)
        add(f"{blk}.attn_q.weight", _q4_0(rng, (q_rows,), shape.hidden), q4)
        add(f"{blk}.attn_k.weight", _q4_0(rng, (kv_rows,), shape.hidden), q4)
        add(f"{blk}.attn_v.weight", _q4_0(rng, (kv_rows,), shape.hidden), q4)
        add(f"{blk}.attn_output.weight", _q4_0(rng, (shape.hidden,), q_rows), q4)
        if shape.moe:
            head_ones = np.ones(shape.head_dim, dtype=np.float32)
            writer.add_tensor(f"{blk}.attn_q_norm.weight", head_ones)
            writer.add_tensor(f"{blk}.attn_k_norm.weight", head_ones)
            router = rng.standard_normal((shape.experts, shape.hidden), dtype=np.float32) * ROUTER_STD
            writer.add_tensor(f"{blk}.ffn_gate_inp.weight", router)
            add(f"{blk}.ffn_gate_exps.weight", _q4_0(rng, (shape.experts, shape.inner), shape.hidden), q4)
            add(f"{blk}.ffn_up_exps.weight", _q4_0(rng, (shape.experts, shape.inner), shape.hidden), q4)
            add(f"{blk}.ffn_down_exps.weight", _q4_0(rng, (shape.experts, shape.hidden), shape.inner), q4)
        else:
            add(f"{blk}.ffn_gate.weight", _q4_0(rng, (shape.inner,), shape.hidden), q4)
            add(f"{blk}.ffn_up.weight", _q4_0(rng, (shape.inner,), shape.hidden), q4)
            add(f"{blk}.ffn_down.weight", _q4_0(rng, (shape.hidden,), shape.inner), q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, path)
    return path


def _rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` (``VmRSS``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _decode_tok_s(timing: object) -> float:
    tokens, decode_s = timing.tokens, timing.decode_s  # type: ignore[attr-defined]
    return (tokens - 1) / decode_s if decode_s > 0 else float("nan")


def measure(shape: Shape, gguf_path: Path, layers: int, tokens: int, runs: int, threads: int) -> dict[str, object]:
    """One shape's interleaved decode run (module doc); its JSON line."""
    from benchmarks import llama_cpp
    from benchmarks.client import chat_once, warm_up
    from benchmarks.mesh import MeshSpec, running_mesh
    from benchmarks.prompts import prompt_token_ids
    from benchmarks.rounds import interleave
    from benchmarks.timing import StreamTiming
    from tests.tiny_model import _build_tokenizer

    prompt = prompt_token_ids(_build_tokenizer(), PROMPT)
    load_before = os.getloadavg()
    nodes_info: dict[str, list[dict[str, float]]] = {}

    def llama_stream() -> StreamTiming:
        run = llama_cpp.run_streams(gguf_path, prompt, 1, tokens, threads)
        return StreamTiming(tokens=tokens, first_s=run.first_s, last_s=run.wall_s, prompt_tokens=len(prompt))

    with contextlib.ExitStack() as stack:
        contenders: dict[str, Callable[[], StreamTiming]] = {"llama.cpp": llama_stream}
        for count in (1, 2):
            began = time.perf_counter()
            env = {"OMP_NUM_THREADS": str(threads), "MESHNET_SPECULATE": "off"}
            mesh = stack.enter_context(running_mesh(MeshSpec(model=str(gguf_path), num_layers=layers, nodes=count,
                                                             node_env=env)))
            up_s = time.perf_counter() - began
            warm_up(mesh.url, mesh.model, PROMPT)
            nodes_info[f"{count} node"] = [{"rss_mib": round(_rss_mib(node.proc.pid), 1)} for node in mesh.nodes]
            nodes_info[f"{count} node"].append({"mesh_up_s": round(up_s, 1)})
            contenders[f"{count} node"] = functools.partial(chat_once, mesh.url, mesh.model, PROMPT, tokens)
        timings = interleave(contenders, runs, log=logger.info,
                             describe=lambda t: f"{_decode_tok_s(t):.2f} tok/s, {t.tokens} tokens")
    rates = {name: round(statistics.median(_decode_tok_s(t) for t in runs_), 3) for name, runs_ in timings.items()}
    return {"shape": shape.name, "layers": layers, "file": gguf_path.name,
            "file_mib": round(gguf_path.stat().st_size / (1 << 20), 1), "tokens": tokens, "runs": runs,
            "threads": threads, "decode_tok_s": rates,
            "vs_llama_cpp": {name: round(rate / rates["llama.cpp"], 3) for name, rate in rates.items()},
            "nodes": nodes_info, "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in args.shapes:
        shape = SHAPES[name]
        began = time.perf_counter()
        path = write_shape(shape, args.layers, CACHE)
        logger.info("%s: %s (%.0f MiB) ready in %.1f s", name, path, path.stat().st_size / (1 << 20),
                    time.perf_counter() - began)
        print(json.dumps(measure(shape, path, args.layers, args.tokens, args.runs, args.threads)), flush=True)


if __name__ == "__main__":
    main()
