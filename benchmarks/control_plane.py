"""Benchmark 6: the control plane: tracker route lookups/s, the proxy's added latency, bootstrap lookups/s.

- Route lookups: a tracker with two registered nodes covering a 30-layer
  model answers ``GET /v1/route`` (plan and sign a route) as fast as it can,
  driven by :mod:`benchmarks.load` over keep-alive connections.
- Proxy latency: a 1-node mesh of the tiny model answers a one-token,
  non-streamed chat completion through the tracker and, alternately, straight
  from the head node (with the tracker's signed route and the mesh secret, as
  the tracker sends it). The difference of each pair is what the tracker's
  proxy adds to a request.
- Bootstrap lookups: a bootstrap registry with 4 prefill ranks (world 4,
  data-parallel 2) answers ``GET /route`` for the ranks and the sizes.
- Stores: the route lookups again with the registry in a real Redis
  (``MESHNET_STORE=redis://...``), on one tracker and on two trackers sharing
  it (both loaded at once; the row is their sum), and the proxy's added
  latency on a tracker whose store is Redis, through one tracker and
  alternately through two. Each route and chat on a Redis tracker costs one
  ``MGET`` first (the view's freshness fence, see
  ``services/tracker/store/redis.py``). Skipped, and said so, where
  ``redis-server`` is not installed.

The load generator shares the machine's cores with the service it measures,
so these are lower bounds of what the service does on a core of its own.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import httpx
import orjson

from benchmarks.client import chat_body
from benchmarks.harness import Harness, pick
from benchmarks.load import hammer
from benchmarks.mesh import MeshSpec, num_layers_of, running_mesh
from benchmarks.plots import Bars, save_figure
from benchmarks.results import Outcome, Row
from benchmarks.stats import Spread, spread
from meshwire import headers
from tests.procs import Service, start_service, wait_healthy
from tests.redis_server import RedisServer

TITLE: Final = "Control plane: route lookups/s, the tracker proxy's added latency, bootstrap lookups/s"
CONNECTIONS: Final = 8
"""Concurrent keep-alive connections of the load generator."""
FAKE_MODEL: Final = "bench/route-lookups"
FAKE_LAYERS: Final = 30
FAKE_NODES: Final = ((0, 14), (15, 29))
"""Two registered nodes covering the fake model's layers; nothing listens at their endpoints."""
UNREACHABLE: Final = "http://127.0.0.1:9"
BOOTSTRAP_WORLD: Final = 4
BOOTSTRAP_DP: Final = 2
PROMPT: Final = ({"role": "user", "content": "Hello!"},)
WARMUP_REQUESTS: Final = 3
ROUTE_WAIT_S: Final = 120.0
"""Longest wait for a freshly started node to be routable."""

LogFn = Callable[[str], None]


def run(harness: Harness) -> Outcome:
    log = harness.logger("control_plane").info
    rounds = pick(harness.quick, full=3, fast=2)
    duration = 3.0 if not harness.quick else 1.5
    pairs = pick(harness.quick, full=40, fast=10)

    route_rates = _route_lookups(rounds, duration, log)
    via_tracker, direct, added = _proxy_latency(harness, pairs, log)
    bootstrap_rates = _bootstrap_lookups(rounds, duration, log)
    store_rows, store_series = _store_rows(harness, rounds, duration, pairs, log)
    rows = (
        Row(label="tracker: GET /v1/route (plan and sign a 2-node route)", value=route_rates, unit="lookups/s",
            note=f"{CONNECTIONS} keep-alive connections"),
        Row(label="one-token chat through the tracker (tiny model, 1 node)", value=via_tracker, unit="ms"),
        Row(label="the same chat straight from the head node", value=direct, unit="ms"),
        Row(label="added by the tracker's proxy", value=added, unit="ms", note="per request, paired runs"),
        Row(label="bootstrap: GET /route (addresses registry, 4 ranks)", value=bootstrap_rates,
            unit="lookups/s", note=f"{CONNECTIONS} keep-alive connections"),
        *store_rows,
    )
    series = {"connections": CONNECTIONS, "duration_s": duration,
              "route_lookups_per_s": list(route_rates.samples),
              "bootstrap_lookups_per_s": list(bootstrap_rates.samples),
              "via_tracker_ms": list(via_tracker.samples), "direct_ms": list(direct.samples),
              "added_ms": list(added.samples), **store_series}
    return Outcome(rows=rows, series=series)


def _rates(service: Service, paths: list[str], rounds: int, duration: float, label: str,
           log: LogFn) -> Spread:
    rates: list[float] = []
    for index in range(1, rounds + 1):
        result = asyncio.run(hammer(service.host, service.port, paths, concurrency=CONNECTIONS,
                                    duration_s=duration))
        if result.refused:
            raise RuntimeError(f"{label}: {result.refused} refusals, e.g. {result.first_refusal}")
        rates.append(result.per_second)
        log(f"{label} round {index}/{rounds}: {result.per_second:.0f}/s ({result.ok} in {result.seconds:.1f} s)")
    return spread(rates)


def _route_lookups(rounds: int, duration: float, log: LogFn, store: str = "memory", trackers: int = 1) -> Spread:
    """Route lookups/s of ``trackers`` trackers on ``store``, loaded at once (the sum of their rates)."""
    secret = "bench-control-plane"
    env = {"MESHNET_SECRET": secret, "MESHNET_NODE_TTL_S": "3600", "MESHNET_HEARTBEAT_S": "60",
           "MESHNET_STORE": store}
    started = [start_service("tracker", env) for _ in range(trackers)]
    try:
        for index, (start, end) in enumerate(FAKE_NODES):
            body = {"node_id": f"fake-{index}", "model": FAKE_MODEL, "endpoint": f"{UNREACHABLE}",
                    "shard_start": start, "shard_end": end, "num_layers": FAKE_LAYERS}
            answer = httpx.post(f"{started[0].url}/v1/nodes", json=body,
                                headers={"Authorization": f"Bearer {secret}"}, timeout=10.0)
            answer.raise_for_status()
        path = f"/v1/route?model={FAKE_MODEL}"
        for tracker in started:
            httpx.get(tracker.url + path, timeout=10.0).raise_for_status()
        if trackers == 1:
            kind = "memory" if store == "memory" else "Redis"
            return _rates(started[0], [path], rounds, duration, f"tracker route lookups ({kind})", log)
        return _rates_together(started, [path], rounds, duration, f"route lookups ({trackers} trackers, Redis)", log)
    finally:
        for tracker in started:
            tracker.stop()


def _rates_together(services: list[Service], paths: list[str], rounds: int, duration: float, label: str,
                    log: LogFn) -> Spread:
    """Like :func:`_rates`, with every service loaded at the same time; each round's rate is their sum."""
    async def together() -> list[Any]:
        return list(await asyncio.gather(*(hammer(s.host, s.port, paths, concurrency=CONNECTIONS // len(services),
                                                  duration_s=duration) for s in services)))

    rates: list[float] = []
    for index in range(1, rounds + 1):
        results = asyncio.run(together())
        refused = [r for r in results if r.refused]
        if refused:
            raise RuntimeError(f"{label}: {refused[0].refused} refusals, e.g. {refused[0].first_refusal}")
        rates.append(sum(r.per_second for r in results))
        log(f"{label} round {index}/{rounds}: {rates[-1]:.0f}/s in all")
    return spread(rates)


def _store_rows(harness: Harness, rounds: int, duration: float, pairs: int,
                log: LogFn) -> tuple[tuple[Row, ...], dict[str, Any]]:
    """The Redis store's rows (route lookups on one and two trackers, proxy latency); none without Redis."""
    binary = shutil.which("redis-server")
    if binary is None:
        log("redis-server is not installed (make setup installs it where apt and root exist): no Redis rows")
        return (), {}
    redis = RedisServer(binary).start()
    try:
        one = _route_lookups(rounds, duration, log, store=_emptied(redis), trackers=1)
        two = _route_lookups(rounds, duration, log, store=_emptied(redis), trackers=2)
        via_one, direct_one, added_one = _proxy_latency_on(harness, pairs, log, _emptied(redis), trackers=1)
        via_two, direct_two, added_two = _proxy_latency_on(harness, pairs, log, _emptied(redis), trackers=2)
    finally:
        redis.stop()
    note = f"{CONNECTIONS} keep-alive connections"
    rows = (
        Row(label="tracker on Redis: GET /v1/route (plan and sign a 2-node route)", value=one, unit="lookups/s",
            note=note),
        Row(label="two trackers on one Redis: GET /v1/route, both loaded at once", value=two, unit="lookups/s",
            note=f"{note} in all, the sum of both"),
        Row(label="one-token chat through a tracker on Redis", value=via_one, unit="ms"),
        Row(label="added by the proxy of a tracker on Redis", value=added_one, unit="ms",
            note="per request, paired runs"),
        Row(label="added by the proxy, alternating two trackers on one Redis", value=added_two, unit="ms",
            note="per request, paired runs"),
    )
    series = {"redis_route_lookups_per_s": list(one.samples), "redis_two_trackers_route_lookups_per_s":
              list(two.samples), "redis_via_tracker_ms": list(via_one.samples),
              "redis_direct_ms": list(direct_one.samples), "redis_added_ms": list(added_one.samples),
              "redis_two_via_tracker_ms": list(via_two.samples), "redis_two_direct_ms": list(direct_two.samples),
              "redis_two_added_ms": list(added_two.samples)}
    return rows, series


def _emptied(redis: RedisServer) -> str:
    """``redis``'s URL, its database emptied first (each measurement starts from no nodes)."""
    client = redis.client()
    try:
        client.flushdb()
    finally:
        client.close()
    return redis.url


def _proxy_latency_on(harness: Harness, pairs: int, log: LogFn, store: str,
                      trackers: int) -> tuple[Spread, Spread, Spread]:
    """:func:`_proxy_latency` on ``trackers`` trackers sharing ``store``; requests alternate between them."""
    folder = harness.tiny_model
    secret = "bench-control-plane-store"
    auth = {"Authorization": f"Bearer {secret}"}
    env = {"MESHNET_SECRET": secret, "MESHNET_STORE": store}
    started = [start_service("tracker", env) for _ in range(trackers)]
    try:
        node = start_service("node", {
            "MESHNET_SECRET": secret, "MESHNET_MODEL": str(folder), "MESHNET_DTYPE": "float32",
            "MESHNET_DEVICE": "cpu", "MESHNET_NODE_ID": "bench-store-node",
            "MESHNET_TRACKER": ",".join(t.url for t in started)})
        started.append(node)
        wait_healthy(node)
        with httpx.Client(timeout=60.0) as client:
            route = _wait_route(client, started[0].url, str(folder), auth)
            for tracker in started[:trackers]:
                _wait_route(client, tracker.url, str(folder), auth)
            body = chat_body(route["model"], PROMPT, 1, stream=False)
            head = route["nodes"][0]["endpoint"].rstrip("/")
            direct_headers = {headers.ROUTE: route["token"], **auth}

            def timed(url: str, extra: dict[str, str]) -> float:
                began = time.perf_counter()
                answer = client.post(url + "/v1/chat/completions", content=body,
                                     headers={"Content-Type": "application/json", **extra})
                elapsed = (time.perf_counter() - began) * 1000
                if answer.status_code != 200:
                    raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text[:500]}")
                orjson.loads(answer.content)
                return elapsed

            for index in range(WARMUP_REQUESTS):
                timed(started[index % trackers].url, {})
                timed(head, direct_headers)
            via, straight = [], []
            for index in range(1, pairs + 1):
                via.append(timed(started[index % trackers].url, {}))
                straight.append(timed(head, direct_headers))
                if index % 10 == 0 or index == pairs:
                    log(f"proxy latency on Redis ({trackers} tracker(s)) pair {index}/{pairs}: via tracker "
                        f"{via[-1]:.1f} ms, direct {straight[-1]:.1f} ms")
    finally:
        for service in reversed(started):
            service.stop()
    return spread(via), spread(straight), spread([a - b for a, b in zip(via, straight, strict=True)])


def _wait_route(client: httpx.Client, tracker: str, model: str, auth: dict[str, str]) -> dict[str, Any]:
    """Poll ``GET /v1/route`` until the tracker has one for ``model``."""
    deadline = time.monotonic() + ROUTE_WAIT_S
    while time.monotonic() < deadline:
        answer = client.get(f"{tracker}/v1/route", params={"model": model}, headers=auth)
        if answer.status_code == 200:
            route: dict[str, Any] = answer.json()
            return route
        time.sleep(0.1)
    raise RuntimeError(f"{tracker} had no route for {model} after {ROUTE_WAIT_S:.0f} s")


def _proxy_latency(harness: Harness, pairs: int, log: LogFn) -> tuple[Spread, Spread, Spread]:
    folder = harness.tiny_model
    spec = MeshSpec(model=str(folder), num_layers=num_layers_of(folder), nodes=1)
    with running_mesh(spec) as mesh, httpx.Client(timeout=60.0) as client:
        body = chat_body(mesh.model, PROMPT, 1, stream=False)
        route = mesh.route()
        head = route["nodes"][0]["endpoint"].rstrip("/")
        direct_headers = {"Content-Type": "application/json", headers.ROUTE: route["token"], **mesh.auth()}

        def timed(url: str, extra: dict[str, str]) -> float:
            began = time.perf_counter()
            answer = client.post(url + "/v1/chat/completions", content=body,
                                 headers={"Content-Type": "application/json", **extra})
            elapsed = (time.perf_counter() - began) * 1000
            if answer.status_code != 200:
                raise RuntimeError(f"{url} answered {answer.status_code}: {answer.text[:500]}")
            orjson.loads(answer.content)
            return elapsed

        for _ in range(WARMUP_REQUESTS):
            timed(mesh.url, {})
            timed(head, direct_headers)
        via, straight = [], []
        for index in range(1, pairs + 1):
            via.append(timed(mesh.url, {}))
            straight.append(timed(head, direct_headers))
            if index % 10 == 0 or index == pairs:
                log(f"proxy latency pair {index}/{pairs}: via tracker {via[-1]:.1f} ms, direct {straight[-1]:.1f} ms")
    return spread(via), spread(straight), spread([a - b for a, b in zip(via, straight, strict=True)])


def _bootstrap_lookups(rounds: int, duration: float, log: LogFn) -> Spread:
    with start_service("bootstrap", {"MESHNET_REGISTRY": "addresses", "MESHNET_ACCESS_LOG": "false"}) as bootstrap:
        tp = BOOTSTRAP_WORLD // BOOTSTRAP_DP
        for rank in range(BOOTSTRAP_WORLD):
            body = {"role": "Prefill", "world_size": BOOTSTRAP_WORLD, "dp_size": BOOTSTRAP_DP,
                    "rank_ip": f"10.0.0.{rank + 1}", "rank_port": 9000 + rank, "engine_rank": rank}
            httpx.put(f"{bootstrap.url}/route", json=body, timeout=10.0).raise_for_status()
        paths = [f"/route?engine_rank={rank % tp}&target_dp_group={rank // tp}" for rank in range(BOOTSTRAP_WORLD)]
        paths.append("/route?engine_rank=-1&target_dp_group=-1")
        for path in paths:
            httpx.get(bootstrap.url + path, timeout=10.0).raise_for_status()
        return _rates(bootstrap, paths, rounds, duration, "bootstrap lookups", log)


def plot(outcome: Outcome, path: Path, caption: str) -> Path:
    series = outcome.series
    return save_figure(path, TITLE, [
        Bars(title=f"lookups/s ({series['connections']} connections)", ylabel="lookups/s",
             bars=[("tracker GET /v1/route", spread(series["route_lookups_per_s"])),
                   ("bootstrap GET /route", spread(series["bootstrap_lookups_per_s"]))]),
        Bars(title="one-token chat latency (tiny model)", ylabel="ms",
             bars=[("through the tracker", spread(series["via_tracker_ms"])),
                   ("straight from the head", spread(series["direct_ms"])),
                   ("added by the proxy", spread(series["added_ms"]))]),
        *_store_bars(series),
    ], caption)


def _store_bars(series: dict[str, Any]) -> list[Bars]:
    """Memory against Redis, one tracker against two (when the run had Redis)."""
    if "redis_route_lookups_per_s" not in series:
        return []
    return [
        Bars(title="route lookups/s by store", ylabel="lookups/s",
             bars=[("memory, 1 tracker", spread(series["route_lookups_per_s"])),
                   ("Redis, 1 tracker", spread(series["redis_route_lookups_per_s"])),
                   ("Redis, 2 trackers", spread(series["redis_two_trackers_route_lookups_per_s"]))]),
        Bars(title="proxy's added latency by store", ylabel="ms",
             bars=[("memory, 1 tracker", spread(series["added_ms"])),
                   ("Redis, 1 tracker", spread(series["redis_added_ms"])),
                   ("Redis, 2 trackers", spread(series["redis_two_added_ms"]))]),
    ]
