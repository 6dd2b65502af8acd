"""Benchmark 8: speculative steps along the route across an emulated WAN (default model, 2 nodes, RTT 50 ms).

Three 2-node meshes behind WAN proxies (:mod:`benchmarks.wan_proxy`, RTT
:data:`RTT_MS`, :data:`~benchmarks.wan.BANDWIDTH_MBIT` Mbit/s) whose heads run
``--speculate off``, ``auto`` and ``on``, each asked two greedy prompts: one
whose answer copies text (repeat a code snippet with one change: prompt
lookup's best case) and one that copies nothing (a story). Runs are
interleaved. Each row gives decode tok/s with its ratio to ``off`` on the same
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
CODE: Final = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
COPY_MESSAGES: Final[tuple[Message, ...]] = (
    {"role": "user", "content": "Repeat this code exactly, but rename the function cheapest to lowest_price:\n\n"
                                + CODE},
)
PROMPTS: Final[dict[str, tuple[Message, ...]]] = {"copying": COPY_MESSAGES, "no copying": DECODE_MESSAGES}


@dataclass(frozen=True)
class SpecRun:
    """One timed generation and what the head's speculation did during it."""

    timing: StreamTiming
    drafted: float
    accepted: float
    speculative_steps: float


def _head_counters(mesh: Mesh) -> tuple[float, float, float]:
    """The head's drafted and accepted tokens and speculative decode steps so far."""
    values = {"drafted": 0.0, "accepted": 0.0, "steps": 0.0}
    text = httpx.get(f"{mesh.nodes[0].url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshnet_node_drafted_tokens_total":
                values["drafted"] = sample.value
            elif sample.name == "meshnet_node_accepted_tokens_total":
                values["accepted"] = sample.value
            elif sample.name == "meshnet_node_decode_steps_total" and sample.labels.get("speculative") == "true":
                values["steps"] = sample.value
    return values["drafted"], values["accepted"], values["steps"]


def _measured(mesh: Mesh, messages: tuple[Message, ...], max_tokens: int) -> SpecRun:
    before = _head_counters(mesh)
    timing = chat_once(mesh.url, mesh.model, messages, max_tokens)
    after = _head_counters(mesh)
    return SpecRun(timing, after[0] - before[0], after[1] - before[1], after[2] - before[2])


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
            rows.append(Row(label=f"RTT {RTT_MS:g} ms, {label(mode, name)}: decode", value=rate, unit="tok/s",
                            note=detail))
            if mode != "off":
                goal = "goal ≥ 2x" if name == "copying" else "goal ≥ 0.95x"
                rows.append(Row(label=f"RTT {RTT_MS:g} ms, {label(mode, name)}: against off", unit="x",
                                value=ratio(rate, baseline), note=goal))
            series[label(mode, name)] = {"tokens_per_s": list(rate.samples), "tokens": [r.timing.tokens for r in runs],
                                         "ttft_ms": [r.timing.ttft_s * 1000 for r in runs], "drafted": drafted,
                                         "accepted": accepted, "speculative_steps": steps}
    return Outcome(rows=tuple(rows), series=series,
                   notes=((f"2 nodes behind WAN proxies at RTT {RTT_MS:g} ms; greedy; {max_tokens} tokens; "
                          "k and acceptance from the head's /metrics"),))


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    panels = [Bars(title=f"{name}: decode tok/s at RTT {RTT_MS:g} ms", ylabel="tok/s",
                   bars=[(mode, spread(series[label(mode, name)]["tokens_per_s"])) for mode in MODES])
              for name in PROMPTS]
    return save_figure(path, TITLE, panels, caption)
