"""What one layer of the model costs this node: bytes of weights and KV cache, and seconds of a decode row.

A node started without ``--layers`` tells the tracker these figures and its
memory budget (``--max-memory``) and is given a range (see
:mod:`services.node.hop.placement_client`). They are measured, not guessed:
:func:`measure_layer_costs` loads layer 0 alone in the format the node will
hold (dtype, packed weights), counts its tensors' bytes, and times a few decode
rows through it on the node's device. Loading one layer of a model is cheap;
the probe is dropped before the real range loads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import torch
from transformers import PretrainedConfig

from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard

logger = logging.getLogger(__name__)

FREE_MEMORY_SHARE: Final = 0.8
"""Share of the memory found free that a node without ``--max-memory`` budgets for (the rest: Python, torch)."""
PROBE_PROMPT_TOKENS: Final = 8
PROBE_UNTIMED_STEPS: Final = 4
PROBE_TIMED_STEPS: Final = 8
"""Fewest decode rows timed."""
PROBE_MIN_S: Final = 0.5
"""Shortest the timed rows last together: longer than a CPU quota's period (a cgroup's 100 ms), so a node
given half a core is timed at half a core's speed, not at the full core it bursts on for a few rows."""
PROBE_MAX_STEPS: Final = 4096
"""Most decode rows timed (a fast device stops here, well before :data:`PROBE_MIN_S`)."""
PROBE_CACHE_TOKENS: Final = 64
"""Rows one probe cache takes before a fresh one is started (the rows are timed at a short context)."""
FALLBACK_FREE_BYTES: Final = 1 << 30
"""Budget assumed where free memory cannot be read (neither CUDA nor ``/proc/meminfo``)."""


@dataclass(frozen=True)
class LayerProbe:
    """One layer's costs on this node (see the module doc)."""

    num_layers: int
    layer_bytes: int
    """Weights of one decoder layer in the held format."""
    head_bytes: int
    """The embedding (and rotary tables) the first layer's holder adds."""
    tail_bytes: int
    """The final norm and LM head the last layer's holder adds (the LM head is the embedding's shape, so it is
    counted as the embedding's bytes plus the norm's)."""
    kv_bytes_per_token: int
    """KV cache of one token in one layer."""
    seconds_per_layer: float
    """One decode row through one layer."""


def _tensor_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def kv_bytes_per_token(config: PretrainedConfig, itemsize: int) -> int:
    """Keys and values of one token in one layer."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * kv_heads * head_dim * itemsize


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for this node now: the GPU's free memory on CUDA, else the machine's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return FALLBACK_FREE_BYTES


def default_budget_bytes(device: torch.device) -> int:
    """The budget of a node without ``--max-memory``: most of the memory found free."""
    return int(free_memory_bytes(device) * FREE_MEMORY_SHARE)


def _time_decode_rows(shard: Shard) -> float:
    """Seconds one decode row takes through the probe's layer (after a short prompt and untimed steps),
    timed over at least :data:`PROBE_TIMED_STEPS` rows and :data:`PROBE_MIN_S` seconds (see there)."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = shard.new_cache()

        def step(tokens: int) -> None:
            states = torch.randn((1, tokens, shard.hidden_size), generator=generator).to(shard.dtype)
            shard.run_layers(states.to(shard.device), cache, cache.seq_len, from_layer=shard.start)

        step(PROBE_PROMPT_TOKENS)
        for _ in range(PROBE_UNTIMED_STEPS):
            step(1)
        if shard.device.type == "cuda":
            torch.cuda.synchronize(shard.device)
        timed, steps = 0.0, 0
        while steps < PROBE_TIMED_STEPS or (timed < PROBE_MIN_S and steps < PROBE_MAX_STEPS):
            if cache.seq_len >= PROBE_CACHE_TOKENS:
                cache = shard.new_cache()
                step(PROBE_PROMPT_TOKENS)  # a fresh short context; its prompt is not a decode row
            began = time.perf_counter()
            step(1)
            if shard.device.type == "cuda":
                torch.cuda.synchronize(shard.device)
            timed += time.perf_counter() - began
            steps += 1
    return timed / steps


def measure_layer_costs(path: Path, dtype: torch.dtype, device: torch.device, weights: str = "float",
                        gguf: Path | None = None, kv_dtype: str = "auto") -> LayerProbe:
    """Load layer 0 alone as the node will hold it; its bytes, its KV bytes a token, and a decode row's time."""
    shard = load_shard(path, 0, 0, dtype, device, weights, gguf, kv_dtype)  # type: ignore[arg-type]
    layer_bytes = _tensor_bytes(shard.modules.model.layers)
    head_bytes = max(0, shard.weight_bytes() - layer_bytes)
    itemsize = torch.empty((), dtype=shard.kv_dtype or shard.dtype).element_size()
    norm_bytes = shard.hidden_size * torch.empty((), dtype=shard.dtype).element_size()
    seconds = _time_decode_rows(shard)
    probe = LayerProbe(num_layers=shard.num_layers, layer_bytes=layer_bytes, head_bytes=head_bytes,
                       tail_bytes=head_bytes + norm_bytes, kv_bytes_per_token=kv_bytes_per_token(shard.config, itemsize),
                       seconds_per_layer=seconds)
    logger.info("one layer here: %.2f MiB of weights, %d bytes of KV a token, %.2f ms a decode row; "
                "the embedding %.2f MiB", layer_bytes / (1 << 20), probe.kv_bytes_per_token, seconds * 1000,
                head_bytes / (1 << 20))
    del shard
    return probe
