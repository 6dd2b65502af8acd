"""What verification costs and how fast it catches a wrong node (issue 37).

``python -m benchmarks.verify`` starts a tracker, a head for the first half of
the layers and two honest replicas of the second half (float32, batching on),
then, in one run:

1. throughput on :data:`STREAMS` concurrent chats at ``MESHNET_VERIFY_RATE``
   0, 0.01 and 0.05, the rates interleaved round by round (changed on the
   running tracker with ``POST /v1/admin/verify``) so that the machine's load,
   shared with whoever else runs, falls on each rate alike;
2. detection latency: a third replica with ``--fault corrupt-output:f`` for f
   = 100%, 10% and 1% joins; chats run (:data:`STREAMS` at a time, at
   :data:`DETECT_RATE`) until the tracker quarantines it, and the mesh's decode
   steps and seconds since it joined are recorded (capped at
   :data:`DETECT_CAP_S`; chats of :data:`DETECT_MAX_TOKENS` tokens).

The model is the test suite's tiny 4-layer Llama by default (``--model
default`` for SmolLM2-135M, slower). The load average is recorded with the
numbers: other people's work on the machine moves them. Results go to
``results/verify.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import httpx

from tests.procs import Service, start_service

logger = logging.getLogger("benchmarks.verify")

STREAMS: Final = 8
RATES: Final = (0.0, 0.01, 0.05)
FAULT_RATES: Final = (1.0, 0.1, 0.01)
DETECT_RATE: Final = 0.05
DETECT_CAP_S: Final = 600.0
MAX_TOKENS: Final = 48
DETECT_MAX_TOKENS: Final = 200
"""Tokens a chat decodes while a faulty replica is hunted: ``--fault`` draws which *positions* it corrupts (the
same in every session), so sessions must span enough positions for a fraction f of them to be hit (the 1%
injector's first corrupted position is 181)."""
PROMPTS: Final = tuple(f"Tell me {n} things about {topic}." for n in range(2, 6)
                       for topic in ("rivers", "the moon", "bread", "owls", "maps", "salt", "tea"))
RESULT: Final = Path(__file__).resolve().parent / "results" / "verify.json"
TIMEOUT_S: Final = 300.0


def _nodes(tracker: Service) -> dict[str, dict[str, Any]]:
    listed = httpx.get(f"{tracker.url}/v1/nodes", timeout=30).json()["nodes"]
    return {node["node_id"]: node for node in listed if node["state"] != "offline"}


def _wait(condition: Any, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


class Bench:
    """The running mesh and how to drive it."""

    def __init__(self, model_dir: Path) -> None:
        self.secret = secrets.token_urlsafe(24)
        self.failures = 0
        self.started: list[Service] = []
        self.tracker = self._start("tracker", {"MESHNET_VERIFY_RATE": "0", "MESHNET_HEARTBEAT_S": "1"})
        layers = int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])
        half = layers // 2
        self.common = {"MESHNET_MODEL": str(model_dir), "MESHNET_DTYPE": "float32", "MESHNET_DEVICE": "cpu",
                       "MESHNET_TRACKER": self.tracker.url}
        self.back = f"{half}-{layers - 1}"
        for name, span in (("head", f"0-{half - 1}"), ("r1", self.back), ("r2", self.back)):
            self.node(name, span)
        _wait(lambda: {"head", "r1", "r2"} <= set(_nodes(self.tracker)), "the mesh to register")
        self.model = _nodes(self.tracker)["head"]["model"]

    def _start(self, kind: str, env: dict[str, str]) -> Service:
        service = start_service(kind, {"MESHNET_SECRET": self.secret, **env}, ready_timeout_s=TIMEOUT_S)  # type: ignore[arg-type]
        self.started.append(service)
        return service

    def node(self, name: str, span: str, extra: dict[str, str] | None = None) -> Service:
        return self._start("node", {**self.common, "MESHNET_NODE_ID": name, "MESHNET_LAYERS": span, **(extra or {})})

    def rate(self, rate: float) -> None:
        answer = httpx.post(f"{self.tracker.url}/v1/admin/verify", json={"rate": rate},
                            headers={"Authorization": f"Bearer {self.secret}"}, timeout=30)
        answer.raise_for_status()

    def chat(self, index: int, max_tokens: int = MAX_TOKENS) -> int:
        body = {"model": self.model, "messages": [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
                "max_tokens": max_tokens, "temperature": 0}
        answer = httpx.post(f"{self.tracker.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
        if answer.status_code != 200:  # counted, not fatal: the run goes on and says how many failed
            logger.warning("a chat failed: %d %s", answer.status_code, answer.text[:300])
            self.failures += 1
            return 0
        return int(answer.json()["usage"]["completion_tokens"])

    def burst(self, start: int, count: int = STREAMS, max_tokens: int = MAX_TOKENS) -> tuple[int, float]:
        """``count`` chats at once; the tokens they decoded and the seconds it took."""
        began = time.perf_counter()
        with ThreadPoolExecutor(STREAMS) as pool:
            tokens = sum(pool.map(lambda index: self.chat(index, max_tokens), range(start, start + count)))
        return tokens, time.perf_counter() - began

    def stop(self) -> None:
        for service in reversed(self.started):
            service.stop()


def throughput(bench: Bench, rounds: int) -> dict[str, Any]:
    """Tokens a second on :data:`STREAMS` streams at each rate, interleaved round by round."""
    per_rate: dict[float, list[float]] = {rate: [] for rate in RATES}
    bench.burst(0)  # warm up
    for round_index in range(rounds):
        for rate in RATES if round_index % 2 == 0 else tuple(reversed(RATES)):
            bench.rate(rate)
            tokens, seconds = bench.burst(round_index * STREAMS)
            per_rate[rate].append(tokens / seconds)
            logger.info("round %d rate %.2f: %.1f tokens/s", round_index, rate, tokens / seconds)
    base = statistics.median(per_rate[0.0])
    return {str(rate): {"tokens_per_s_median": round(statistics.median(values), 2),
                        "runs": [round(v, 2) for v in values],
                        "vs_rate_0": round(statistics.median(values) / base - 1, 4)}
            for rate, values in per_rate.items()}


def detection(bench: Bench, fault_rate: float) -> dict[str, Any]:
    """Steps and seconds until a replica corrupting ``fault_rate`` of its steps is quarantined."""
    name = f"bad-{int(fault_rate * 100)}"
    bench.rate(DETECT_RATE)
    bad = bench.node(name, bench.back, {"MESHNET_FAULT": f"corrupt-output:{fault_rate}", "MESHNET_ALLOW_FAULTS": "1"})
    try:
        _wait(lambda: name in _nodes(bench.tracker), f"{name} to register")
        began, steps, index = time.perf_counter(), 0, 0
        while time.perf_counter() - began < DETECT_CAP_S:
            tokens, _ = bench.burst(index, max_tokens=DETECT_MAX_TOKENS)
            steps, index = steps + tokens, index + STREAMS
            if _nodes(bench.tracker)[name].get("quarantined"):
                return {"fault_rate": fault_rate, "verify_rate": DETECT_RATE, "caught": True, "steps": steps,
                        "seconds": round(time.perf_counter() - began, 1)}
        return {"fault_rate": fault_rate, "verify_rate": DETECT_RATE, "caught": False, "steps": steps,
                "seconds": round(time.perf_counter() - began, 1)}
    finally:
        bad.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (the test model, default) or 'default' (SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-throughput", action="store_true",
                        help="measure detection only (the throughput of the last run's results file is kept)")
    parser.add_argument("--skip-detection", action="store_true",
                        help="measure throughput only (the detection of the last run's results file is kept)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[verify] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as scratch:
        if args.model == "tiny":
            from tests.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(scratch) / "tiny")
        else:
            from services.node.model.model_source import resolve_model

            model_dir = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path
        bench = Bench(model_dir)
        try:
            load_before = os.getloadavg()
            result = {"model": args.model, "streams": STREAMS, "max_tokens": MAX_TOKENS,
                      "throughput": (json.loads(RESULT.read_text())["throughput"]
                                     if args.skip_throughput and RESULT.exists() else throughput(bench, args.rounds)),
                      "detect_max_tokens": DETECT_MAX_TOKENS,
                      "detection": (json.loads(RESULT.read_text())["detection"]
                                    if args.skip_detection and RESULT.exists()
                                    else [detection(bench, fault) for fault in FAULT_RATES]),
                      "load_average_before": [round(v, 2) for v in load_before],
                      "load_average_after": [round(v, 2) for v in os.getloadavg()],
                      "cpus": os.cpu_count(), "failed_chats": bench.failures}
        finally:
            bench.stop()
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
