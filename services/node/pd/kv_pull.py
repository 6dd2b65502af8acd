"""A decode node's side of a handoff: check the prefill group's layout, find the prefill nodes in the signed
prefill route, pull, check each answer's signature.

For a decode hop that runs layers ``first..last`` of a request prefilled on
the prefill nodes (:class:`~meshwire.kv_handoff.HandoffSource`):

1. ``GET /route?engine_rank=-1&target_dp_group=-1`` on the bootstrap registry
   gives the prefill group's cache layout; a layout that is not this node's
   refuses the handoff (:class:`HandoffFailed` ``layout_mismatch``, naming the
   difference);
2. the handoff's signed prefill route (``X-Meshnet-Handoff-Route``, verified
   with the tracker's keys like any route) names which prefill node holds
   which layers, at which endpoint, with which hop key. That is the only
   address this node pulls from: the bootstrap registry's ``rank_ip`` is not
   used for pulls (anyone who reaches the registry could have registered it,
   and it could name any host: a man in the middle or an SSRF). An endpoint on
   a link-local or cloud-metadata address is refused even there;
3. each node's layers are pulled in chunks of whole pages (``POST /kv/pull``,
   carrying this node's signed decode route, naming the prefill node it is for
   and signed with this node's hop key: :mod:`services.node.pd.kv_auth`, with a
   fresh X25519 key the answer is sealed to: :mod:`meshwire.kv_box`); each
   answer must be signed by that prefill node's hop key over the chunk, this
   node's id and the pull's own proof
   (:func:`~meshwire.kv_handoff.pull_answer_problem`), and is a frame checked
   against what was asked (dtype, shape, positions) before it is appended to
   the session's cache.

Step 3 runs on a background thread at a lower CPU priority
(:mod:`services.node.engine.background`, ``--kv-pull-nice``), in chunks of at most
:data:`PULL_CHUNK_BYTES`, with its own blocking HTTP client: receiving and
copying tens of megabytes then takes the core only while this node's decode
steps leave it free, so the streams it already serves keep their pace while a
long prompt is handed over (``python -m benchmarks.pd``).

The whole pull is bounded by ``timeout_s``. Any failure raises
:class:`HandoffFailed` with a reason (``bootstrap``, ``layout_mismatch``,
``bad_route``, ``prefill_unreachable``, ``pull_refused``, ``bad_chunk``,
``bad_signature``, ``timeout``): the decode route then prefills the prompt
itself, so the answer is the same.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx

from meshwire import headers as h
from meshwire.bootstrap_client import AsyncBootstrapClient, BootstrapError, PrefillInfo, RetryPolicy
from meshwire.frames import TORCH_DTYPES, FrameError, FrameLimits, decode_frame
from meshwire.hop_proof import PROOF, sign_request
from meshwire.kv_box import BOX, BoxProblem, Opener
from meshwire.kv_handoff import (
    KV_CHUNK_POSITIONS,
    KV_LAYERS,
    KV_POSITIONS,
    KV_SOURCE,
    MAX_PULL_ANSWER_EXTRA,
    PULL_PATH,
    HandoffSource,
    KVShape,
    cache_layout,
    chunk_positions,
    format_layers,
    layout_difference,
    pull_answer_problem,
)
from meshwire.route_keys import KeyProblem, SigningKey, public_key_from_text
from meshwire.routes import Route, RouteError, verify_route
from meshwire.targets import forbidden_target
from services.node.engine.background import BackgroundPool
from services.node.engine.compute import one_torch_thread
from services.node.hop.trust import RouteTrust
from services.node.metrics import NodeMetrics
from services.node.model.kv_cache import ShardCache
from services.node.pd.kv_transfer import KVTransferError, append_kv, held_positions
from services.node.settings import DEFAULT_NICE

logger = logging.getLogger(__name__)

LAYOUT_CACHE_S: Final = 5.0
"""How long the registry's layout and placement are reused before they are asked again."""
BOOTSTRAP_TIMEOUT_S: Final = 5.0
BOOTSTRAP_RETRY: Final = RetryPolicy(attempts=2, backoff_s=0.1, max_backoff_s=0.5)
"""A handoff does not wait long for the registry: the decode route can always prefill itself."""
PULL_CHUNK_BYTES: Final = 8 << 20
"""Bytes a pull chunk holds at most (fewer when ``--max-frame-bytes`` is lower): one chunk is in memory at a
time, and its copy into the cache is one stretch of work on the pull thread."""
PULL_WORKERS: Final = 2
"""Pulls that run at once (more wait their turn): each is memory bandwidth the decode steps also need."""


class HandoffFailed(Exception):
    """This node could not take a handoff's KV over; ``reason`` is the metric label, ``str()`` the why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class StageSource:
    """Where one prefill node of the signed prefill route serves the layers this node needs, and its key."""

    stage: int
    first: int
    last: int
    url: str
    node_id: str
    hop_key: Any
    """The prefill node's public hop key (Ed25519): its answers must be signed with it."""


class _Stopped(Exception):
    """The pull's caller gave up (timeout, cancelled request): the pull thread stops where it is."""


class _PullJob:
    """One pull's cache and its stop switch, shared by the waiting coroutine and the pull thread.

    Appends happen under ``lock`` after checking the switch, and :meth:`stop` throws it under the same
    lock: once the waiter has stopped a job, the thread never writes to the cache again (the session may
    be prefilled afresh or freed).
    """

    def __init__(self, cache: ShardCache, device: Any) -> None:
        self.cache = cache
        self.device = device
        self.lock = threading.Lock()
        self._stopped = threading.Event()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop the pull; waits for an append in progress (one chunk's copy) to end."""
        with self.lock:
            self._stopped.set()

    def append(self, first: int, chunk: Any) -> None:
        with self.lock:
            if self._stopped.is_set():
                raise _Stopped
            append_kv(self.cache, first, chunk, self.device)


class KvPuller:
    """Pulls a handoff's KV for some layers from the prefill nodes the bootstrap registry names."""

    def __init__(self, *, node_id: str, hop_key: SigningKey, bootstrap_url: str, trust: RouteTrust, model_id: str,
                 shape: KVShape, max_chunk_bytes: int, timeout_s: float, metrics: NodeMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, verify: ssl.SSLContext | bool = True,
                 nice: int = DEFAULT_NICE) -> None:
        self._node_id = node_id
        self._hop_key = hop_key
        self._trust = trust
        self._model_id = model_id
        self._bootstrap = AsyncBootstrapClient(bootstrap_url, timeout_s=BOOTSTRAP_TIMEOUT_S, retry=BOOTSTRAP_RETRY)
        self.shape = shape
        self.layout: dict[str, Any] = cache_layout(shape)
        self._max_chunk_bytes = min(max_chunk_bytes, PULL_CHUNK_BYTES)
        self._timeout_s = timeout_s
        self._clock = clock
        self._metrics = metrics
        self._info: tuple[float, PrefillInfo] | None = None
        self._verify = verify
        self._pool = BackgroundPool("kv-pull", workers=PULL_WORKERS, nice=nice, setup=one_torch_thread)
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()

    async def prefill_info(self) -> PrefillInfo:
        """The registry's sizes, layout and placement (reused for :data:`LAYOUT_CACHE_S`)."""
        now = self._clock()
        if self._info is not None and now - self._info[0] < LAYOUT_CACHE_S:
            return self._info[1]
        try:
            info = await self._bootstrap.get_sizes()
        except BootstrapError as exc:
            raise HandoffFailed("bootstrap", f"the bootstrap registry could not be asked: {exc}") from None
        self._info = (now, info)
        return info

    async def layout_problem(self) -> HandoffFailed | None:
        """Why a handoff to this node cannot work now (no group, another layout), or ``None``."""
        try:
            info = await self.prefill_info()
        except HandoffFailed as exc:
            return exc
        difference = layout_difference(self.layout, info.cache_layout)
        if difference is not None:
            return HandoffFailed("layout_mismatch", f"refusing the prefill group's KV: {difference}; the decode "
                                                    "route prefills the prompt itself")
        if not info.cache_fields_by_stage:
            return HandoffFailed("bootstrap", "the bootstrap registry has no stage placement for the prefill group")
        return None

    async def pull_into(self, cache: ShardCache, source: HandoffSource, first: int, last: int,
                        device: Any, route_token: str) -> int:
        """Append layers ``first..last`` of ``source``'s KV to the empty ``cache``; the bytes pulled.

        ``route_token`` is the signed decode route this node runs those layers on: the prefill nodes
        hold the KV for that route's nodes only.
        """
        began = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout_s):
                pulled = await self._pull(cache, source, first, last, device, route_token)
        except TimeoutError:
            self._count("failed")
            raise HandoffFailed("timeout", f"pulling the prompt's KV took over {self._timeout_s:.0f} s") from None
        except HandoffFailed:
            self._count("failed")
            raise
        self._count("ok")
        if self._metrics is not None:
            self._metrics.kv_pulled_bytes.inc(pulled)
            self._metrics.kv_pull_seconds.observe(time.perf_counter() - began)
        logger.info("pulled %d bytes of KV (layers %d-%d, %d positions) in %.1f ms", pulled, first, last,
                    source.positions, (time.perf_counter() - began) * 1000)
        return pulled

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.kv_pulls.labels(outcome=outcome).inc()

    async def _pull(self, cache: ShardCache, source: HandoffSource, first: int, last: int, device: Any,
                    route_token: str) -> int:
        problem = await self.layout_problem()
        if problem is not None:
            raise problem
        stages = await self._stages(source, first, last)
        job = _PullJob(cache, device)
        work = self._pool.submit(lambda: sum(self._pull_stage(job, source, stage, route_token) for stage in stages))
        try:
            pulled = await asyncio.wrap_future(work)
        except asyncio.CancelledError:  # a timeout or a request gone: the thread must not write on
            job.stop()
            raise
        lengths = held_positions(cache, first, last)
        if lengths != {source.positions}:
            raise HandoffFailed("bad_chunk", f"after the pull layers {first}-{last} hold {sorted(lengths)} positions, "
                                             f"not {source.positions}")
        cache.entry_layer = first
        return pulled

    async def _prefill_route(self, source: HandoffSource) -> Route:
        """The handoff's signed prefill route, verified with the tracker's keys; :class:`HandoffFailed`
        ``bad_route`` when there is none or it does not hold."""
        if source.route is None:
            raise HandoffFailed("bad_route", "the handoff names no signed prefill route to pull from")
        try:
            await self._trust.ensure(source.route)
            route = verify_route(source.route, self._trust.keys, check_expiry=False)
        except RouteError as exc:
            raise HandoffFailed("bad_route", f"the handoff's prefill route is refused ({exc.code}): {exc}") from None
        if route.model != self._model_id:
            raise HandoffFailed("bad_route", f"the handoff's prefill route is for {route.model[:100]}, this node "
                                             f"serves {self._model_id}")
        return route

    async def _stages(self, source: HandoffSource, first: int, last: int) -> list[StageSource]:
        """Which prefill node of the signed prefill route serves which of layers ``first..last``, and where."""
        route = await self._prefill_route(source)
        out: list[StageSource] = []
        for stage, node in enumerate(route.nodes):
            low, high = max(first, node.start_layer), min(last, node.shard_end)
            if low > high:
                continue
            if node.hop_key is None:
                raise HandoffFailed("bad_route", f"the prefill route names no hop key for {node.node_id}: its KV "
                                                 "could not be checked")
            problem = forbidden_target(node.endpoint)
            if problem is not None:
                raise HandoffFailed("bad_route", f"refusing to pull from {node.node_id} at {node.endpoint[:200]}: "
                                                 f"{problem}")
            try:
                key = public_key_from_text(node.hop_key)
            except KeyProblem as exc:
                raise HandoffFailed("bad_route", f"{node.node_id}'s hop key: {exc}") from None
            out.append(StageSource(stage, low, high, node.endpoint.rstrip("/"), node.node_id, key))
        covered = {layer for stage in out for layer in range(stage.first, stage.last + 1)}
        if covered != set(range(first, last + 1)):
            raise HandoffFailed("bad_route", f"the prefill route does not hold every layer of {first}-{last}")
        return out

    def _pull_stage(self, job: _PullJob, source: HandoffSource, stage: StageSource, route_token: str) -> int:
        """Pull one stage's layers chunk by chunk into the job's cache (on a pull thread); the bytes pulled."""
        layers = stage.last - stage.first + 1
        per_chunk = chunk_positions(layers, self.shape, self._max_chunk_bytes)
        total = -(-source.positions // per_chunk)
        pulled = 0
        for index in range(total):
            start = index * per_chunk
            count = min(source.positions, start + per_chunk) - start
            expected = (2 * layers, self.shape.kv_heads, count, self.shape.head_dim)
            chunk = self._fetch(job, stage, source, index, total, per_chunk, expected, route_token)
            try:
                job.append(stage.first, chunk)
            except KVTransferError as exc:
                raise HandoffFailed("bad_chunk", str(exc)) from None
            pulled += chunk.numel() * chunk.element_size()
        return pulled

    def _client(self) -> httpx.Client:
        """This pull thread's own keep-alive client (a blocking one: the thread has no event loop)."""
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(http1=True, http2=False, verify=self._verify,
                                  timeout=httpx.Timeout(self._timeout_s, connect=BOOTSTRAP_TIMEOUT_S))
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _fetch(self, job: _PullJob, stage: StageSource, source: HandoffSource, index: int, total: int,
               per_chunk: int, expected: tuple[int, ...], route_token: str) -> Any:
        opener = Opener()  # the answer is sealed to this pull's own key
        headers = {h.WIRE: h.WIRE_VERSION, h.ROUTE: route_token, h.SESSION: source.session,
                   KV_LAYERS: format_layers(stage.first, stage.last), h.CHUNK_INDEX: str(index),
                   KV_CHUNK_POSITIONS: str(per_chunk), KV_SOURCE: stage.node_id, BOX: opener.public_text}
        headers.update(sign_request(self._hop_key, self._node_id, PULL_PATH, headers, b""))
        nbytes = 1
        for dim in expected:
            nbytes *= dim
        nbytes *= self.shape.itemsize
        limit = nbytes + MAX_PULL_ANSWER_EXTRA
        try:
            with self._client().stream("POST", f"{stage.url}{PULL_PATH}", headers=headers) as response:
                body = bytearray()
                for part in response.iter_bytes():
                    if job.stopped:
                        raise _Stopped
                    body += part
                    if len(body) > limit:
                        raise HandoffFailed("bad_chunk", f"a KV chunk from stage {stage.stage} is over {limit} bytes")
                status, answer_headers = response.status_code, response.headers
        except httpx.HTTPError as exc:
            raise HandoffFailed("prefill_unreachable", f"prefill stage {stage.stage} at {stage.url} could not be "
                                                       f"reached: {type(exc).__name__}: {exc}") from None
        if status != 200:
            raise HandoffFailed("pull_refused", f"prefill stage {stage.stage} refused the pull: HTTP {status} "
                                                f"{bytes(body[:300]).decode('utf-8', 'replace')}")
        problem = pull_answer_problem(stage.hop_key, stage.node_id, answer_headers, body,
                                      requester=self._node_id, request_proof=headers[PROOF])
        if problem is not None:  # not the prefill node the route names, or not its answer to this pull
            raise HandoffFailed("bad_signature", f"a KV chunk from {stage.node_id} at {stage.url} is refused: "
                                                 f"{problem}")
        try:
            plain = opener.open(answer_headers.get(BOX), body, headers[PROOF])
        except BoxProblem as exc:
            raise HandoffFailed("bad_signature", f"a KV chunk from {stage.node_id} cannot be opened: {exc}") from None
        try:
            frame = decode_frame(answer_headers, plain, FrameLimits(max_bytes=nbytes))
        except FrameError as exc:
            raise HandoffFailed("bad_chunk", f"a KV chunk from stage {stage.stage} is not a frame: {exc}") from None
        if (tuple(frame.tensor.shape) != expected or frame.chunk_index != index or frame.chunk_total != total
                or frame.header(KV_POSITIONS) != str(source.positions)
                or frame.tensor.dtype != _dtype(self.shape.dtype)):
            raise HandoffFailed("bad_chunk", f"chunk {index} of stage {stage.stage} is {list(frame.tensor.shape)} "
                                             f"{frame.tensor.dtype}, chunk {frame.chunk_index}/{frame.chunk_total}; "
                                             f"expected {list(expected)} {self.shape.dtype}, chunk {index}/{total}")
        return frame.tensor

    async def aclose(self) -> None:
        self._pool.shutdown()
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        await self._bootstrap.aclose()


def _dtype(name: str) -> Any:
    return TORCH_DTYPES[name]  # type: ignore[index]
