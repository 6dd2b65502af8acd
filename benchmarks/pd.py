"""Prefill/decode on different nodes: do long prompts still stall the streams decoding beside them?

One mesh, real processes: a ``cache-layouts`` bootstrap registry, a tracker,
a decode node and a prefill node, each holding every layer of the model, the
decode node pinned to core 0 and the prefill node to core 1 (two machines'
worth of cores on one box). Four streams decode short prompts through the
tracker. Three phases, each of ``--seconds``:

* ``quiet``: the four streams alone;
* ``no PD``: long prompts (``--long-tokens`` tokens, one after another)
  sent straight to the decode node without a prefill route: today's path,
  the prompt runs in the decode node's compute slots;
* ``PD``: the same long prompts through the tracker, which prefills them on
  the prefill node; the decode node pulls their KV.

Reported: the streams' time between tokens (p50, p99) per phase, the long
prompts' time to first token per phase, and, from the decode node's metrics,
the KV bytes pulled and the pull time per 1,000 prompt tokens.

    python -m benchmarks.pd [--model M] [--long-tokens 2048] [--seconds 60] [--kv-dtype float16]

``--kv-dtype`` keeps both nodes' KV caches in 16 bits (``results/pd-kv-<dtype>.json``).

Where the rest runs (``--front``): by default the bootstrap, the tracker and
this script's clients are not pinned (the scheduler puts them on either
core). ``--front decode-core`` puts them on core 0 with the decode node, so
the prefill node has core 1 to itself as a machine of its own would
(``results/pd-...-front-decode-core.json``); on the 2-core EPYC of 2026-12-02
that made every phase slower (quiet p50 13.4 -> 15.0 ms, PD p99 25.9 -> 29.9)
and the ratio to the quiet p50 about the same (1.92x, 1.99x).

The machine this runs on may be shared (the load average at the start is
printed): read the figures as a comparison of the phases, not as absolutes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.machine import describe_machine
from benchmarks.mesh import pin_process
from tests.procs import TEST_SECRET, Service, start_service, wait_healthy

STREAMS = 4
STREAM_TOKENS = 64
SHORT = [{"role": "user", "content": "Write a short poem about the sea."}]
PARAGRAPH = ("The river ran past the old mill, where the wheel turned slowly in the morning light and the miller "
             "counted sacks of grain while the children watched the water. ")
AUTH = {"Authorization": f"Bearer {TEST_SECRET}"}
RESULTS = Path(__file__).resolve().parent / "results" / "pd.json"


def long_prompt(tokens: int) -> list[dict[str, str]]:
    """A user message of about ``tokens`` tokens (the paragraph is about 33.7 tokens of SmolLM2's tokenizer)."""
    return [{"role": "user", "content": PARAGRAPH * max(1, round(tokens / 33.7)) + "Summarise the story."}]


async def stream(client: httpx.AsyncClient, url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
                 headers: dict[str, str] | None = None) -> tuple[float, list[float], int]:
    """One streamed chat: (time to first token, arrival time of every content chunk, prompt tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    arrivals: list[float] = []
    prompt_tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", content=orjson.dumps(body),
                             headers={"Content-Type": "application/json", **(headers or {})}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                arrivals.append(time.perf_counter())
            elif line.startswith("data: {") and '"usage"' in line:
                usage = orjson.loads(line[6:]).get("usage") or {}
                prompt_tokens = int(usage.get("prompt_tokens") or 0)
    return (arrivals[0] - began if arrivals else float("nan")), arrivals, prompt_tokens


async def phase(name: str, tracker: str, decode: str, model: str, seconds: float, long_tokens: int | None,
                pd: bool) -> dict[str, Any]:
    """Four streams for ``seconds`` (restarted as they end), long prompts arriving meanwhile (if any)."""
    gaps: list[float] = []
    ttfts: list[float] = []
    prompt_tokens: list[int] = []
    deadline = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=600) as client:
        async def streamer() -> None:
            while time.perf_counter() < deadline:
                _, arrivals, _ = await stream(client, tracker, model, SHORT, STREAM_TOKENS)
                gaps.extend(b - a for a, b in itertools.pairwise(arrivals))

        async def prompter() -> None:
            assert long_tokens is not None
            while time.perf_counter() < deadline:
                url, headers = (tracker, None) if pd else (decode, AUTH)
                ttft, _, tokens = await stream(client, url, model, long_prompt(long_tokens), 4, headers)
                ttfts.append(ttft)
                prompt_tokens.append(tokens)

        tasks = [streamer() for _ in range(STREAMS)] + ([prompter()] if long_tokens else [])
        await asyncio.gather(*tasks)
    ms = sorted(g * 1000 for g in gaps)
    out = {"phase": name, "gaps": len(ms), "tbt_p50_ms": _pct(ms, 50), "tbt_p99_ms": _pct(ms, 99),
           "gaps_by_ms": _histogram(ms),
           "long_prompts": len(ttfts), "long_prompt_tokens": sum(prompt_tokens),
           "ttft_s": [round(t, 2) for t in ttfts], "ttft_median_s": statistics.median(ttfts) if ttfts else None}
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


GAP_BUCKETS_MS: tuple[float, ...] = (35, 42, 50, 75, 100, 200, 500)
"""Upper bounds of the buckets a phase's gaps are counted in: where a p99 comes from."""


def _histogram(ms: list[float]) -> dict[str, int]:
    """How many gaps fall in each bucket of :data:`GAP_BUCKETS_MS` (``"<=35"``, ..., ``">500"``)."""
    out = {f"<={bound:g}": 0 for bound in GAP_BUCKETS_MS} | {f">{GAP_BUCKETS_MS[-1]:g}": 0}
    for value in ms:
        bound = next((b for b in GAP_BUCKETS_MS if value <= b), None)
        out[f"<={bound:g}" if bound is not None else f">{GAP_BUCKETS_MS[-1]:g}"] += 1
    return out


def _pct(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(len(values) * pct / 100))], 2)


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if (sample.name.startswith(("meshnet_node_kv_pull", "meshnet_node_pd_")) and not sample.labels.get("le")
                    and not sample.name.endswith("_created")):
                key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
                out[key] = float(sample.value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float16", "bfloat16"],
                        help="KV cache format of both nodes (MESHNET_KV_DTYPE); the results file is named after it")
    parser.add_argument("--front", default="any", choices=["any", "decode-core"],
                        help="where the bootstrap, the tracker and the clients run: on any core (default), or on "
                             "the decode node's core")
    args = parser.parse_args()
    if args.front == "decode-core":  # this process's clients, and the services it starts (they inherit it)
        os.sched_setaffinity(0, {0})
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f} on {os.cpu_count()} cores", file=sys.stderr)
    services: list[Service] = []
    try:
        bootstrap = start_service("bootstrap", {"MESHNET_REGISTRY": "cache-layouts"})
        services.append(bootstrap)
        tracker = start_service("tracker", {"MESHNET_HEARTBEAT_S": "1", "MESHNET_PD_MIN_PROMPT_TOKENS": "512"})
        services.append(tracker)
        common = {"MESHNET_MODEL": args.model, "MESHNET_DTYPE": args.dtype, "MESHNET_DEVICE": "cpu",
                  "MESHNET_TRACKER": tracker.url, "MESHNET_BOOTSTRAP": bootstrap.url, "MESHNET_HEARTBEAT_S": "1",
                  "MESHNET_THREADS": "1", "OMP_NUM_THREADS": "1", "MESHNET_CPU_LOCK": "off",
                  "MESHNET_KV_DTYPE": args.kv_dtype}
        decode = start_service("node", {**common, "MESHNET_ROLE": "decode", "MESHNET_NODE_ID": "decode"},
                               wait_ready=False)
        prefill = start_service("node", {**common, "MESHNET_ROLE": "prefill", "MESHNET_NODE_ID": "prefill"},
                                wait_ready=False)
        services += [decode, prefill]
        pin_process(decode.proc.pid, 0)
        pin_process(prefill.proc.pid, 1 % (os.cpu_count() or 1))
        wait_healthy(decode, 600)
        wait_healthy(prefill, 600)
        pin_process(decode.proc.pid, 0)  # threads started while loading
        pin_process(prefill.proc.pid, 1 % (os.cpu_count() or 1))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            nodes = {n["node_id"]: n for n in httpx.get(f"{tracker.url}/v1/nodes", headers=AUTH).json()["nodes"]}
            if nodes.get("prefill", {}).get("pd_rank") is not None and "decode" in nodes:
                break
            time.sleep(0.5)
        model = nodes["decode"]["model"]
        asyncio.run(phase("warm-up", tracker.url, decode.url, model, 5, args.long_tokens, True))
        before = metrics(decode.url)
        results = [asyncio.run(phase("quiet", tracker.url, decode.url, model, args.seconds, None, False)),
                   asyncio.run(phase("no PD", tracker.url, decode.url, model, args.seconds, args.long_tokens, False)),
                   asyncio.run(phase("PD", tracker.url, decode.url, model, args.seconds, args.long_tokens, True))]
        after = metrics(decode.url)
        pulled = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        prompt_tokens = results[2]["long_prompt_tokens"]
        summary = {
            "machine_load_at_start": load, "machine": describe_machine().one_line(), "front": args.front,
            "model": model, "long_tokens": args.long_tokens, "kv_dtype": args.kv_dtype,
            "phases": results, "decode_node_metrics_delta": pulled,
            "kv_bytes_per_1000_prompt_tokens": (pulled.get("meshnet_node_kv_pulled_bytes_total", 0) / prompt_tokens
                                                * 1000) if prompt_tokens else None,
            "pull_seconds_per_1000_prompt_tokens": (pulled.get("meshnet_node_kv_pull_seconds_sum", 0) / prompt_tokens
                                                    * 1000) if prompt_tokens else None,
            "command": " ".join(sys.argv),
        }
        name = RESULTS.stem + ("" if args.kv_dtype == "auto" else f"-kv-{args.kv_dtype}") + (
            "" if args.front == "any" else f"-front-{args.front}")
        results_file = RESULTS.with_name(f"{name}.json")
        results_file.parent.mkdir(parents=True, exist_ok=True)
        results_file.write_text(json.dumps(summary, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        for service in reversed(services):
            service.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
