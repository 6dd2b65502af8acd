"""Placement against an even split, on three nodes of unequal CPU, and the time healing takes.

Run alone (it loads the default model nine times and takes the machine's cores):

    PYTHONPATH=libs:. python -m benchmarks.placement [--rounds 3] [--streams 8] [--tokens 32]
        [--meshes even placed placed-80MB] [--no-heal]

Three "machines" are simulated with cgroup (v1) CPU quotas of 0.5, 1 and 1.5
cores (:data:`CORES`; ``/sys/fs/cgroup/cpu``, root needed; where that cannot be
written the benchmark says so and stops, since ``taskset`` can only give whole
cores and this machine has two). Each node gets ``ceil(cores)`` torch threads and
no CPU lock (``MESHNET_CPU_LOCK=off``: they are separate machines). Three meshes of
the default model run side by side, each with its own tracker:

- ``even``: the nodes pinned to an even split (``--layers`` 0-9, 10-19, 20-29);
- ``placed``: the nodes started without ``--layers`` within their share of the free
  memory, as ``meshnet up`` starts them (where memory allows, each holds the whole
  model and the tracker routes streams over the replicas);
- ``placed-80MB``: the nodes without ``--layers`` at ``--max-memory 80MB`` (the
  issue's test: the tracker must split the model by memory).

Once a mesh covers the model the tracker may re-cut its placed nodes by speed
(services/tracker/placement_tune.py): the benchmark waits until no move is under
way (:func:`settle`) and records the first layout, the moves and the settled one.
Rounds are interleaved (even, placed, placed-80MB, then again) so the machine's
background load, which other people share, falls on each alike; each round is
``--streams`` greedy streamed chats at once, and its figure is the tokens of all of
them over the round's wall time. Then the head of ``placed-80MB`` is killed and the
seconds until the tracker lists the model complete again are measured (the
node's lease runs out first: the tracker's TTL, 6 s by default, is part of it).
Results go to ``benchmarks/results/placement.json`` with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import secrets
import signal
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import openai

from tests.procs import Service, start_service

logger = logging.getLogger("benchmarks.placement")

CORES: Final = (0.5, 1.0, 1.5)
"""CPU quota of each simulated machine, in cores."""
CGROUP_ROOT: Final = Path("/sys/fs/cgroup/cpu")
PERIOD_US: Final = 100_000
EVEN: Final = ("0-9", "10-19", "20-29")
BUDGET_80MB: Final = "80MB"
READY_TIMEOUT_S: Final = 900.0
HEAL_TIMEOUT_S: Final = 300.0
POLL_S: Final = 0.2
SETTLE_S: Final = 8.0
"""Quiet seconds (eight heartbeats) after which a mesh's placement counts as settled."""
MESHES: Final = {"even": (EVEN, None), "placed": (None, None), "placed-80MB": (None, BUDGET_80MB)}
RESULTS: Final = Path(__file__).with_name("results") / "placement.json"
PROMPTS: Final = ("What is the capital of France?", "Name three colours.", "What is 2 + 2?",
                  "Write a short sentence about the sea.", "Who wrote Hamlet?", "What do bees make?",
                  "How many days are in a week?", "What is the largest planet?")


class QuotaUnavailable(RuntimeError):
    """CPU quotas cannot be set here (no writable cgroup v1 cpu controller)."""


@dataclass
class Mesh:
    name: str
    tracker: Service
    nodes: list[Service]
    groups: list[Path]

    def stop(self) -> None:
        for service in [*self.nodes, self.tracker]:
            service.stop()
        for group in self.groups:
            with contextlib.suppress(OSError):
                group.rmdir()


def quota_group(name: str, cores: float) -> Path:
    """A cgroup of ``cores`` cores' worth of CPU time."""
    group = CGROUP_ROOT / name
    try:
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
    except OSError as exc:
        raise QuotaUnavailable(f"cannot set a CPU quota in {CGROUP_ROOT}: {exc}") from None
    return group


def start_mesh(name: str, model: str, layers: tuple[str, ...] | None, budget: str | None) -> Mesh:
    secret = secrets.token_urlsafe(24)
    tracker = start_service("tracker", {"MESHNET_SECRET": secret}, ready_timeout_s=READY_TIMEOUT_S)
    mesh = Mesh(name, tracker, [], [])
    for index, cores in enumerate(CORES):
        group = quota_group(f"meshnet-bench-{os.getpid()}-{name}-{index}", cores)
        mesh.groups.append(group)
        env = {"MESHNET_SECRET": secret, "MESHNET_MODEL": model, "MESHNET_TRACKER": tracker.url,
               "MESHNET_DEVICE": "cpu", "MESHNET_NODE_ID": f"{name}-{index}", "MESHNET_CPU_LOCK": "off",
               "MESHNET_THREADS": str(math.ceil(cores)), "OMP_NUM_THREADS": str(math.ceil(cores)),
               "MESHNET_HEARTBEAT_S": "1"}
        if layers is not None:
            env["MESHNET_LAYERS"] = layers[index]
        if budget is not None:
            env["MESHNET_MAX_MEMORY"] = budget
        node = start_service("node", env, wait_ready=False)
        (group / "cgroup.procs").write_text(str(node.proc.pid))  # its threads, and those it starts, share the quota
        mesh.nodes.append(node)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            view = httpx.get(f"{tracker.url}/v1/nodes", timeout=5).json()
            if sum(n["routable"] for n in view["nodes"]) == len(CORES) and view["models"][0]["complete"]:
                return mesh
        for node in mesh.nodes:
            if not node.alive():
                mesh.stop()
                raise RuntimeError(f"{name}: a node exited:\n{node.log()[-3000:]}")
        time.sleep(POLL_S)
    mesh.stop()
    raise RuntimeError(f"{name}: the mesh did not cover the model within {READY_TIMEOUT_S:.0f} s")


def settle(mesh: Mesh) -> list[str]:
    """Wait until the tracker has stopped moving the mesh's nodes (it re-cuts a covered mesh by speed): every
    move told is done or given up, and nothing changed for :data:`SETTLE_S`. The moves made, as text."""
    quiet_since, last = time.monotonic(), None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            model = httpx.get(f"{mesh.tracker.url}/v1/nodes", timeout=5).json()["models"][0]
            moves = model.get("moves") or []
            state = (tuple(layout(mesh)), len(moves))
            open_moves = {m["node_id"] for m in moves if m["event"] == "told"} - {
                m["node_id"] for m in moves if m["event"] != "told"}
            if state != last or open_moves or not model["complete"]:
                quiet_since, last = time.monotonic(), state
            elif time.monotonic() - quiet_since >= SETTLE_S:
                return [f"{m['node_id']} {m['event']} {m['from_layers']} -> {m['to_layers']}" for m in moves]
        time.sleep(POLL_S)
    raise RuntimeError(f"{mesh.name}: placement did not settle within {READY_TIMEOUT_S:.0f} s")


def layout(mesh: Mesh) -> list[str]:
    nodes = httpx.get(f"{mesh.tracker.url}/v1/nodes", timeout=5).json()["nodes"]
    return [f"{n['node_id']} ({CORES[int(n['node_id'].rsplit('-', 1)[1])]} cores): layers {n['shard_start']}-"
            f"{n['shard_end']} {n.get('placement')}" for n in sorted(nodes, key=lambda n: n["node_id"]) if n["routable"]]


def model_of(mesh: Mesh) -> str:
    return str(httpx.get(f"{mesh.tracker.url}/v1/models", timeout=5).json()["data"][0]["id"])


def one_stream(client: openai.OpenAI, model: str, prompt: str, tokens: int) -> int:
    count = 0
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=tokens, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            count += 1
    return count


def round_of(mesh: Mesh, streams: int, tokens: int) -> float:
    """Aggregate tokens a second of ``streams`` streams at once."""
    client = openai.OpenAI(base_url=f"{mesh.tracker.url}/v1", api_key="unused", max_retries=2, timeout=600)
    model = model_of(mesh)
    began = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        counts = list(pool.map(lambda i: one_stream(client, model, PROMPTS[i % len(PROMPTS)], tokens),
                               range(streams)))
    return sum(counts) / (time.perf_counter() - began)


def heal_seconds(mesh: Mesh) -> float:
    """Kill the node holding layer 0 and time until the tracker lists the model complete again."""
    nodes = httpx.get(f"{mesh.tracker.url}/v1/nodes", timeout=5).json()["nodes"]
    head = next(n["node_id"] for n in nodes if n["routable"] and n["shard_start"] == 0)
    mesh.nodes[int(head.rsplit("-", 1)[1])].kill()
    killed = time.monotonic()
    while time.monotonic() - killed < HEAL_TIMEOUT_S:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            view = httpx.get(f"{mesh.tracker.url}/v1/nodes", timeout=5).json()
            live = {n["node_id"] for n in view["nodes"] if n["routable"]}
            if head not in live and view["models"][0]["complete"]:
                return time.monotonic() - killed
        time.sleep(POLL_S)
    raise RuntimeError(f"coverage not restored within {HEAL_TIMEOUT_S:.0f} s:\n{mesh.tracker.log()[-3000:]}")


@contextlib.contextmanager
def meshes(model: str, names: list[str]) -> Iterator[list[Mesh]]:
    started: list[Mesh] = []
    try:
        for name in names:
            layers, budget = MESHES[name]
            logger.info("starting mesh %s", name)
            started.append(start_mesh(name, model, layers, budget))
        yield started
    finally:
        for mesh in started:
            mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--meshes", nargs="+", choices=list(MESHES), default=list(MESHES),
                        help="the meshes to start (fewer: a shorter run; 'even' is the baseline of the ratios)")
    parser.add_argument("--no-heal", action="store_true", help="skip the death-to-coverage measurement")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # stop the meshes too
    from services.node.model.model_source import resolve_model

    resolve_model("default")  # converted once here, not by nine nodes at once
    model = "default"  # the nodes resolve it as a user's would: its GGUF's int4 layers
    with meshes(model, args.meshes) as started:
        first_layouts = {mesh.name: layout(mesh) for mesh in started}
        moves = {mesh.name: settle(mesh) for mesh in started}  # the tracker's re-cuts by speed, if any
        layouts = {mesh.name: layout(mesh) for mesh in started}
        for name, lines in first_layouts.items():
            logger.info("%s as first placed: %s", name, "; ".join(lines))
        for name, lines in layouts.items():
            logger.info("%s: %s", name, "; ".join(lines))
        for mesh in started:  # one untimed round each: caches, the tracker's first measurements
            round_of(mesh, args.streams, args.tokens)
        rates: dict[str, list[float]] = {mesh.name: [] for mesh in started}
        for number in range(args.rounds):
            for mesh in started:
                rates[mesh.name].append(round_of(mesh, args.streams, args.tokens))
                logger.info("round %d %s: %.1f tok/s aggregate", number + 1, mesh.name, rates[mesh.name][-1])
        small = next((mesh for mesh in started if mesh.name == "placed-80MB"), None)
        healed_s = heal_seconds(small) if small is not None and not args.no_heal else None
        healed_layout = layout(small) if healed_s is not None and small is not None else None
    load = os.getloadavg()
    median = {name: statistics.median(values) for name, values in rates.items()}
    result = {
        "cores": CORES, "streams": args.streams, "tokens": args.tokens, "rounds": args.rounds,
        "first_layouts": first_layouts, "moves": moves, "layouts": layouts,
        "aggregate_tok_s": rates, "median_tok_s": median,
        **({f"{name.lower().replace('-', '_')}_over_even": median[name] / median["even"]
            for name in median if name != "even"} if "even" in median else {}),
        "seconds_death_to_coverage_80mb": healed_s, "layout_after_healing": healed_layout,
        "load_average_1_5_15": load, "cpus": os.cpu_count(),
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
