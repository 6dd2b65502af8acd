"""Benchmark 8: speculative steps along the route across an emulated WAN (default model, 2 nodes, RTT 50 ms).

Three 2-node meshes behind WAN proxies (:mod:`benchmarks.wan_proxy`, RTT
:data:`RTT_MS`, :data:`~benchmarks.wan.BANDWIDTH_MBIT` Mbit/s) whose heads run
``--speculate off``, ``auto`` and ``on``, each asked two greedy prompts: one
whose answer copies text (edit a paragraph: the model writes it out again,
prompt lookup's best case) and one that copies nothing (a story). Runs are
interleaved. Each run also reads the head's round trips per token and how a
decode step's wall time splits into compute and the rest (the wire). Each row gives decode tok/s with its ratio to ``off`` on the same
prompt, and for the speculating heads the drafted tokens per speculative step
(the ``k`` chosen) and the share of drafted tokens the tail accepted, read from
the head's ``/metrics`` around each run. The issue's goals: at least 2x on the
copying prompt, never below 0.95x on the other.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.client import chat_once, describe_timing, warm_up
from benchmarks.harness import DEFAULT_MODEL, Harness, pick
from benchmarks.mesh import Mesh, MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Bars, save_figure
from benchmarks.prompts import DECODE_MESSAGES, Message
from benchmarks.results import Outcome, Row
from benchmarks.rounds import interleave
from benchmarks.stats import ratio, spread
from benchmarks.timing import StreamTiming
from benchmarks.wan import link

TITLE: Final = "Speculative steps across an emulated WAN (default model, 2 nodes, RTT 50 ms)"
RTT_MS: Final = 50.0
MODES: Final = ("off", "auto", "on")
PARAGRAPH: Final = (
    "The river runs past the old mill and under the stone bridge before it reaches the sea. In the morning the "
    "fishermen push their boats into the water and sail out beyond the harbour wall. Children walk to school along "
    "the river path, counting the ducks and throwing small stones into the water. The baker opens her shop before "
    "sunrise, and the smell of fresh bread drifts down the narrow street towards the square. By noon the market is "
    "full: farmers sell apples, cheese and honey, and the old clock on the town hall strikes twelve while the "
    "pigeons rise from the roofs.")
COPY_MESSAGES: Final[tuple[Message, ...]] = (
    {"role": "user", "content": "Edit this paragraph: replace 'the sea' with 'the ocean'. Return the whole edited "
                                "paragraph.\n\n" + PARAGRAPH},
)
"""The copying prompt: the default model answers it by writing the paragraph out again (106 tokens, as it stands:
it does not make the edit), so prompt lookup can draft nearly all of it. An earlier prompt asking to repeat a
code snippet with a function renamed was answered with one of its two functions and a sentence about it (65
tokens, about half of them copied): at most 1.7 tokens a step for a perfect verifier at no cost, too little to
measure speculation by."""
PROMPTS: Final[dict[str, tuple[Message, ...]]] = {"copying": COPY_MESSAGES, "no copying": DECODE_MESSAGES}


@dataclass(frozen=True)
class SpecRun:
    """One timed generation and what the head's speculation did during it."""

    timing: StreamTiming
    drafted: float
    accepted: float
    speculative_steps: float
    steps: float = 0.0
    """Decode steps (round trips along the route), speculative or not."""
    step_s: float = 0.0
    """Wall time of those steps at the head."""
    compute_s: float = 0.0
    """The nodes' compute in those steps (the rest is the wire: round trips, HTTP, queues)."""


COUNTERS: Final = {
    "meshnet_node_drafted_tokens_total": "drafted",
    "meshnet_node_accepted_tokens_total": "accepted",
    "meshnet_node_decode_steps_total": "steps",
    "meshnet_node_decode_step_seconds_total": "step_s",
    "meshnet_node_decode_compute_seconds_total": "compute_s",
}


def _head_counters(mesh: Mesh) -> dict[str, float]:
    """The head's speculation counters so far (decode steps also as ``speculative_steps``: those with drafts)."""
    values = dict.fromkeys((*COUNTERS.values(), "speculative_steps"), 0.0)
    text = httpx.get(f"{mesh.nodes[0].url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = COUNTERS.get(sample.name)
            if name is not None:
                values[name] += sample.value
            if sample.name == "meshnet_node_decode_steps_total" and sample.labels.get("speculative") == "true":
                values["speculative_steps"] = sample.value
    return values


def _measured(mesh: Mesh, messages: tuple[Message, ...], max_tokens: int) -> SpecRun:
    before = _head_counters(mesh)
    timing = chat_once(mesh.url, mesh.model, messages, max_tokens)
    after = _head_counters(mesh)
    return SpecRun(timing, **{name: after[name] - before[name] for name in after})


def label(mode: str, prompt: str) -> str:
    return f"speculate {mode}, {prompt}"


def run(harness: Harness) -> Outcome:
    log = harness.logger("wan_spec").info
    runs = pick(harness.quick, full=3, fast=1)
    max_tokens = pick(harness.quick, full=96, fast=32)
    layers = num_layers_of(harness.default_model)
    with contextlib.ExitStack() as stack:
        contenders: dict[str, Callable[[], SpecRun]] = {}
        for mode in MODES:
            spec = MeshSpec(model=DEFAULT_MODEL, num_layers=layers, nodes=2, wan=link(RTT_MS),
                            node_env={"MESHNET_SPECULATE": mode})
            log(f"starting a mesh of {spec.describe()}, speculate {mode}")
            mesh = stack.enter_context(running_mesh(spec))
            warm_up(mesh.url, mesh.model, DECODE_MESSAGES)
            for name, messages in PROMPTS.items():
                contenders[label(mode, name)] = functools.partial(_measured, mesh, messages, max_tokens)
        results = interleave(contenders, runs, log=log, describe=_describe)
    return outcome(results, max_tokens)


def _describe(result: SpecRun) -> str:
    spec = ""
    if result.speculative_steps:
        spec = (f"; k {result.drafted / result.speculative_steps:.1f}, "
                f"accepted {result.accepted / max(result.drafted, 1):.0%}")
    if result.steps:
        spec += (f"; {result.steps / max(result.timing.tokens - 1, 1):.2f} round trips a token, "
                 f"{result.step_s * 1000 / result.steps:.0f} ms a step of which compute "
                 f"{result.compute_s * 1000 / result.steps:.0f} ms")
    return describe_timing(result.timing) + spec


def outcome(results: dict[str, list[SpecRun]], max_tokens: int) -> Outcome:
    rows: list[Row] = []
    series: dict[str, object] = {"max_tokens": max_tokens, "rtt_ms": RTT_MS}
    for name in PROMPTS:
        baseline = spread([r.timing.tokens_per_s for r in results[label("off", name)]]).median
        for mode in MODES:
            runs = results[label(mode, name)]
            rate = spread([r.timing.tokens_per_s for r in runs])
            drafted = sum(r.drafted for r in runs)
            steps = sum(r.speculative_steps for r in runs)
            accepted = sum(r.accepted for r in runs)
            detail = (f"k {drafted / steps:.1f} per speculative step, {accepted / drafted:.0%} of drafts accepted"
                      if steps else "no drafts")
            all_steps = sum(r.steps for r in runs)
            if all_steps:
                decoded = sum(max(r.timing.tokens - 1, 1) for r in runs)
                step_ms = 1000 * sum(r.step_s for r in runs) / all_steps
                compute_ms = 1000 * sum(r.compute_s for r in runs) / all_steps
                detail += (f"; {all_steps / decoded:.2f} round trips a token; a step {step_ms:.0f} ms, "
                           f"compute {compute_ms:.0f} ms")
            rows.append(Row(label=f"RTT {RTT_MS:g} ms, {label(mode, name)}: decode", value=rate, unit="tok/s",
                            note=detail))
            if mode != "off":
                goal = "goal ≥ 2x" if name == "copying" else "goal ≥ 0.95x"
                rows.append(Row(label=f"RTT {RTT_MS:g} ms, {label(mode, name)}: against off", unit="x",
                                value=ratio(rate, baseline), note=goal))
            series[label(mode, name)] = {"tokens_per_s": list(rate.samples), "tokens": [r.timing.tokens for r in runs],
                                         "ttft_ms": [r.timing.ttft_s * 1000 for r in runs], "drafted": drafted,
                                         "accepted": accepted, "speculative_steps": steps, "steps": all_steps,
                                         "step_s": sum(r.step_s for r in runs),
                                         "compute_s": sum(r.compute_s for r in runs)}
    return Outcome(rows=tuple(rows), series=series,
                   notes=((f"2 nodes behind WAN proxies at RTT {RTT_MS:g} ms; greedy; {max_tokens} tokens; "
                          "k and acceptance from the head's /metrics"),))


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    panels = [Bars(title=f"{name}: decode tok/s at RTT {RTT_MS:g} ms", ylabel="tok/s",
                   bars=[(mode, spread(series[label(mode, name)]["tokens_per_s"])) for mode in MODES])
              for name in PROMPTS]
    return save_figure(path, TITLE, panels, caption)
