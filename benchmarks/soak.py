"""The soak test: a mesh with replicas serves steady load while nodes keep dying; nothing may be lost.

    make soak                                   # 10 minutes
    .venv/bin/python -m benchmarks.soak --minutes 2 --streams 8

A tracker and four nodes on the tiny model in float32 (``head-a`` and
``head-b`` hold layers 0-1, ``tail-a`` and ``tail-b`` layers 2-3), all real
processes (:mod:`tests.failover_mesh`). ``--streams`` workers send requests
back to back through the tracker: greedy and seeded, streamed and not. Each
answer is compared with the same request's answer on the quiet mesh before
the chaos began. Meanwhile a chaos loop kills a random node (a head or a
hop, SIGKILL or SIGTERM) whose replica is up, and starts it again on its
port a few seconds later, so some layer range always has a live holder.

It reports, into ``benchmarks/results/soak.json`` and on the terminal:
requests started, completed, identical to their quiet run, different, lost
(cut without an error or an end), errored with a clear message, the kills,
and the p50/p99 time between tokens of streamed answers. Goal: 0 lost and 0
different. Not part of ``make test`` (the failover tests there cover each
case once).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

import httpx
import orjson

from benchmarks.results import RESULTS_DIR
from meshwire.sse import parse_sse_line
from tests.failover_mesh import FailoverMesh, start_mesh

logger = logging.getLogger("benchmarks.soak")

LAYERS: Final = {"head-a": (0, 1), "head-b": (0, 1), "tail-a": (2, 3), "tail-b": (2, 3)}
PARTNER: Final = {"head-a": "head-b", "head-b": "head-a", "tail-a": "tail-b", "tail-b": "tail-a"}
MAX_TOKENS: Final = 48
SEEDS: Final = (1, 2, 3)
KINDS: Final = tuple([("greedy", None, stream) for stream in (True, False)]
                     + [("seeded", seed, stream) for seed in SEEDS for stream in (True, False)])
REQUEST_TIMEOUT_S: Final = 180.0
RESULT_FILE: Final = RESULTS_DIR / "soak.json"


@dataclass
class Tally:
    started: int = 0
    completed: int = 0
    identical: int = 0
    different: int = 0
    lost: int = 0
    errored: int = 0
    kills: int = 0
    restarts: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def sampling(kind: tuple[str, int | None, bool]) -> dict[str, Any]:
    return {"temperature": 0} if kind[0] == "greedy" else {"temperature": 0.8, "seed": kind[1]}


def ask(mesh: FailoverMesh, kind: tuple[str, int | None, bool]) -> tuple[str, str, list[float]]:
    """One request: (outcome, text, gaps between content events in ms); outcome is done / error: ... / lost: ..."""
    body = mesh.body(MAX_TOKENS, sampling(kind), kind[2])
    url = f"{mesh.tracker.url}/v1/chat/completions"
    if not kind[2]:
        try:
            answer = httpx.post(url, json=body, timeout=REQUEST_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"lost: {type(exc).__name__}", "", []
        if answer.status_code != 200:
            error = answer.json().get("error", {}) if answer.headers.get("content-type", "").startswith(
                "application/json") else {}
            return ("error: " + str(error.get("message"))) if error.get("message") else \
                f"lost: HTTP {answer.status_code}", "", []
        return "done", answer.json()["choices"][0]["message"]["content"] or "", []
    text, gaps, last, done, error = "", [], None, False, None
    try:
        with httpx.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                return f"error: HTTP {response.status_code} {response.read()[:200]!r}", "", []
            for line in response.iter_lines():
                data = parse_sse_line(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    done = True
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    error = event["error"].get("message")
                    continue
                for choice in event.get("choices") or []:
                    content = choice.get("delta", {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append((now - last) * 1000)
                        last = now
                        text += content
    except httpx.HTTPError as exc:
        return f"lost: {type(exc).__name__}", text, gaps
    if error:
        return f"error: {error}", text, gaps
    return ("done" if done else "lost: no [DONE]"), text, gaps


def worker(mesh: FailoverMesh, expected: dict[Any, str], tally: Tally, stop: threading.Event, seed: int) -> None:
    chooser = random.Random(seed)
    while not stop.is_set():
        kind = chooser.choice(KINDS)
        with tally.lock:
            tally.started += 1
        outcome, text, gaps = ask(mesh, kind)
        with tally.lock:
            tally.gaps_ms.extend(gaps)
            if outcome == "done":
                tally.completed += 1
                if text == expected[kind]:
                    tally.identical += 1
                else:
                    tally.different += 1
                    tally.problems.append(f"different answer for {kind}")
            elif outcome.startswith("error"):
                tally.errored += 1
                tally.problems.append(f"{kind}: {outcome[:300]}")
            else:
                tally.lost += 1
                tally.problems.append(f"{kind}: {outcome[:300]}")


def chaos(mesh: FailoverMesh, tally: Tally, stop: threading.Event, seed: int, every_s: float) -> None:
    """Kill a node whose replica is up, start it again a few seconds later; again and again."""
    chooser = random.Random(seed)
    while not stop.wait(chooser.uniform(every_s / 2, every_s * 1.5)):
        alive = [name for name, service in mesh.nodes.items() if service.alive()]
        victims = [name for name in alive if PARTNER[name] in alive]
        if not victims:
            continue
        victim = chooser.choice(victims)
        how = chooser.choice((signal.SIGKILL, signal.SIGTERM))
        logger.info("chaos: %s %s", how.name, victim)
        mesh.nodes[victim].kill(how)
        if mesh.nodes[victim].alive():  # a graceful stop still draining: make room for the restart
            mesh.nodes[victim].kill(signal.SIGKILL)
        with tally.lock:
            tally.kills += 1
        if stop.wait(chooser.uniform(2.0, 5.0)):
            break
        try:
            mesh.revive(victim)
        except Exception as exc:  # noqa: BLE001 - a restart that fails is reported, and tried again next round
            logger.warning("chaos: %s did not come back: %s", victim, exc)
            continue
        with tally.lock:
            tally.restarts += 1


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=8, help="concurrent requests, back to back")
    parser.add_argument("--chaos-every", type=float, default=8.0, help="mean seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT_FILE)
    parser.add_argument("--verify-rate", type=float, default=None,
                        help="the tracker's MESHNET_VERIFY_RATE (issue 37): with it, the tracker's spot checks "
                             "are reported too, and any disagreement between the honest tails is a false positive")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress
    from tests.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="meshnet-soak-") as scratch:
        model = build_tiny_model(Path(scratch) / "tiny-model")
        logger.info("starting a tracker and 4 nodes (2 heads, 2 tails) on the tiny model")
        tracker_env = {} if args.verify_rate is None else {"MESHNET_VERIFY_RATE": str(args.verify_rate)}
        mesh = start_mesh(model, LAYERS, {"MESHNET_IDLE_TIMEOUT_S": "10"}, tracker_env)
        try:
            expected = {}
            for kind in KINDS:
                outcome, text, _ = ask(mesh, kind)
                if outcome != "done":
                    raise SystemExit(f"the quiet mesh could not answer {kind}: {outcome}")
                expected[kind] = text
            logger.info("quiet answers recorded for %d kinds of request; soaking for %.1f minutes with %d streams",
                        len(KINDS), args.minutes, args.streams)
            tally, stop = Tally(), threading.Event()
            threads = [threading.Thread(target=worker, args=(mesh, expected, tally, stop, args.seed + i))
                       for i in range(args.streams)]
            threads.append(threading.Thread(target=chaos, args=(mesh, tally, stop, args.seed, args.chaos_every)))
            began = time.monotonic()
            for thread in threads:
                thread.start()
            while time.monotonic() - began < args.minutes * 60:
                time.sleep(min(30.0, args.minutes * 60 - (time.monotonic() - began)) or 0.1)
                with tally.lock:
                    logger.info("soak: %d started, %d identical, %d different, %d lost, %d errored, %d kills",
                                tally.started, tally.identical, tally.different, tally.lost, tally.errored,
                                tally.kills)
            stop.set()
            for thread in threads:
                thread.join()
            checks = verify_checks(mesh) if args.verify_rate is not None else None
        finally:
            mesh.stop()
    summary: dict[str, Any] = {item.name: getattr(tally, item.name) for item in fields(tally)
                               if item.name not in ("gaps_ms", "lock", "problems")}
    summary |= {"minutes": args.minutes, "streams": args.streams, "chaos_every_s": args.chaos_every,
                "p50_gap_ms": percentile(tally.gaps_ms, 0.5), "p99_gap_ms": percentile(tally.gaps_ms, 0.99),
                "mean_gap_ms": statistics.fmean(tally.gaps_ms) if tally.gaps_ms else None,
                "problems": tally.problems[:50], "verify_rate": args.verify_rate, "verify_checks": checks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"soak {args.minutes:g} min, {args.streams} streams: {tally.started} started, {tally.completed} completed, "
          f"{tally.identical} identical, {tally.different} different, {tally.lost} lost, {tally.errored} errored; "
          f"{tally.kills} kills, {tally.restarts} restarts; time between tokens p50 "
          f"{summary['p50_gap_ms'] or 0:.1f} ms, p99 {summary['p99_gap_ms'] or 0:.1f} ms; wrote {args.out}")
    if checks is not None:
        print(f"spot checks at rate {args.verify_rate:g}: {checks}")
    false_positive = checks is not None and (checks["disagree"] > 0 or checks["quarantined"])
    return 0 if tally.lost == 0 and tally.different == 0 and not false_positive else 1


def verify_checks(mesh: Any) -> dict[str, Any]:
    """The tracker's spot checks (``meshnet_verify_checks_total`` by outcome) and who it quarantined: with honest
    nodes only, any disagreement is a false positive."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{mesh.tracker.url}/metrics", timeout=30).text
    outcomes = {sample.labels["outcome"]: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "meshnet_verify_checks_total"}
    nodes = httpx.get(f"{mesh.tracker.url}/v1/nodes", timeout=30).json()["nodes"]
    return {"agree": outcomes.get("agree", 0.0), "disagree": outcomes.get("disagree", 0.0),
            "quarantined": sorted(node["node_id"] for node in nodes if node.get("quarantined"))}


if __name__ == "__main__":
    raise SystemExit(main())
