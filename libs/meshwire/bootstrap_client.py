"""Clients of the PD bootstrap service, for prefill and decode workers.

A prefill (data-source) rank registers its control address::

    async with AsyncBootstrapClient("http://bootstrap:8998") as bootstrap:
        await bootstrap.register_rank(RankRegistration(
            world_size=4, dp_size=2, rank_ip="10.0.0.1", rank_port=7003, engine_rank=3))

and a decode rank reads the prefill node's sizes and looks a rank up, waiting
for it to register if it has not yet::

    async with AsyncBootstrapClient("http://bootstrap:8998") as bootstrap:
        sizes = await bootstrap.get_sizes(wait_s=30)
        address = await bootstrap.lookup_rank(engine_rank=1, dp_group=1, wait_s=30)

Every call has a timeout and retries what may pass: a connection that fails
or times out, and a 502/503/504, with exponential backoff
(:class:`RetryPolicy`). A refusal (the service's text/plain 4xx/500 answer)
is not retried: it raises :class:`BootstrapRefused` with the service's text.
A rank not registered yet raises :class:`RankNotRegistered`, or is waited
for when ``wait_s`` is given. Answers are read up to
:data:`MAX_ANSWER_BYTES` and checked against their models.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, Self, TypeVar

import httpx
import orjson
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from meshwire import tls

DEFAULT_TIMEOUT_S: Final = 5.0
"""Timeout of one HTTP attempt (connect, and each read or write)."""
MAX_ANSWER_BYTES: Final = 1 << 20
"""Largest answer read; a layout is at most 256 KiB."""
RETRY_STATUSES: Final = frozenset({502, 503, 504})
"""Statuses that may pass on their own (a proxy or an overloaded service)."""
ROUTE_PATH: Final = "/route"
HEALTH_PATH: Final = "/health"
SIZES_QUERY: Final = -1
RANK_NOT_FOUND_TEXT: Final = "Bootstrap info not Found"
"""The service's answer to a look-up of a rank not registered (yet)."""

Role = Literal["Prefill", "Decode"]
"""A registering rank's role; only ``Prefill`` ranks are recorded for look-ups."""

_FROZEN: Final = ConfigDict(frozen=True, strict=True, extra="forbid")
_ANSWER: Final = ConfigDict(frozen=True, strict=True, extra="ignore")
Port = Annotated[int, Field(ge=1, le=65_535)]
Size = Annotated[int, Field(ge=1)]

StagePlacement = Annotated[tuple[Annotated[tuple[str, ...], Strict(False)], ...], Strict(False)]
"""Field ids held by each pipeline stage, stage 0 first (lists accepted)."""

Model = TypeVar("Model", bound=BaseModel)


class RankRegistration(BaseModel):
    """The ``PUT /route`` body of one source rank.

    ``engine_rank`` is the rank's dense index in its node (stage-major with
    pipeline parallelism: ``pp_rank * tp + tp_rank``). A ``cache-layouts``
    service also needs ``pp_size``, ``cache_layout`` (the layout's JSON wire
    form) and ``cache_fields_by_stage``.
    """

    model_config = _FROZEN
    role: Role = "Prefill"
    world_size: Size
    dp_size: Size
    rank_ip: Annotated[str, Field(min_length=1, max_length=255)]
    rank_port: Port
    engine_rank: Annotated[int, Field(ge=0)]
    pp_size: Size | None = None
    cache_layout: str | None = None
    cache_fields_by_stage: StagePlacement | None = None
    """Field ids of each stage; lists are accepted (and kept as tuples)."""

    def wire(self) -> bytes:
        """The JSON body, without the optional keys left unset."""
        return orjson.dumps(self.model_dump(exclude_none=True))


class PrefillInfo(BaseModel):
    """The node's parallel sizes (``GET /route?engine_rank=-1&target_dp_group=-1``).

    The sizes are ``None`` until a first rank registers. ``prefill_tp_size``
    is the node's world size, as the reference names it.
    """

    model_config = _ANSWER
    prefill_tp_size: int | None
    prefill_dp_size: int | None
    prefill_pp_size: int
    cache_layout: str | None = None
    cache_fields_by_stage: tuple[tuple[str, ...], ...] | None = None

    @property
    def registered(self) -> bool:
        """Whether any rank has registered the sizes yet."""
        return self.prefill_tp_size is not None and self.prefill_dp_size is not None


class RankAddress(BaseModel):
    """A registered source rank's control address."""

    model_config = _ANSWER
    rank_ip: str
    rank_port: int


class BootstrapError(RuntimeError):
    """A bootstrap call did not succeed."""


class BootstrapUnavailable(BootstrapError):
    """The service could not be reached, or kept failing, through every attempt."""


class BootstrapRefused(BootstrapError):
    """The service answered with a refusal: ``status`` and its text ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"bootstrap refused ({status}): {message}")
        self.status = status
        self.message = message


class RankNotRegistered(BootstrapRefused):
    """No rank is registered at the slot looked up (yet)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how patiently, one call is attempted."""

    attempts: int = 5
    """Attempts in all, the first included."""
    backoff_s: float = 0.1
    """Pause after the first failed attempt; doubled after each one."""
    max_backoff_s: float = 2.0
    """Longest pause between two attempts."""

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("a retry policy needs attempts >= 1 and non-negative pauses")

    def pauses(self) -> Iterator[float]:
        """The pause before each attempt: 0 before the first."""
        yield 0.0
        for attempt in range(self.attempts - 1):
            yield min(self.max_backoff_s, self.backoff_s * (2 ** attempt))


@dataclass(frozen=True)
class _Answer:
    """A complete HTTP answer, read within :data:`MAX_ANSWER_BYTES`."""

    status: int
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class _Patience:
    """How long a look-up waits for a registration: ``wait_s`` from now, pausing longer after each miss
    (from the policy's first pause up to its longest)."""

    def __init__(self, retry: RetryPolicy, wait_s: float) -> None:
        self._deadline = time.monotonic() + wait_s
        self._pause = retry.backoff_s
        self._max_pause = retry.max_backoff_s

    def spent(self) -> bool:
        """Whether the wait is over: one more miss is the answer."""
        return time.monotonic() >= self._deadline

    async def pause(self) -> None:
        await asyncio.sleep(self._pause)
        self._pause = min(self._max_pause, self._pause * 2)


def _lookup_params(engine_rank: int, dp_group: int) -> dict[str, int]:
    return {"engine_rank": engine_rank, "target_dp_group": dp_group}


def _check_ok(answer: _Answer) -> _Answer:
    """``answer`` when it is a 200; else the refusal it carries."""
    if answer.status == 200:
        return answer
    text = answer.text()
    if answer.status == 500 and text == RANK_NOT_FOUND_TEXT:
        raise RankNotRegistered(answer.status, text)
    raise BootstrapRefused(answer.status, text)


def _parse(model: type[Model], answer: _Answer) -> Model:
    try:
        return model.model_validate_json(_check_ok(answer).body)
    except ValidationError as error:
        raise BootstrapError(f"the bootstrap answer is not a {model.__name__}: {error}") from error


def _too_large() -> BootstrapError:
    return BootstrapError(f"the bootstrap answer is over {MAX_ANSWER_BYTES} bytes")


class AsyncBootstrapClient:
    """A client of one bootstrap service (one connection pool; close it, or use ``async with``).

    The one client: its callers (the node's PD member and KV pull) run in an event loop. A
    blocking caller runs one call with ``asyncio.run``.
    """

    def __init__(self, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy = RetryPolicy(),
                 transport: httpx.AsyncBaseTransport | None = None, tls_ca: str | None = None) -> None:
        """``tls_ca`` verifies an ``https://`` service (``MESHNET_TLS_CA``; default: the system's roots)."""
        self.base_url = base_url.rstrip("/")
        self.retry = retry
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport,
                                       verify=tls.httpx_verify(tls_ca))

    async def health(self) -> bool:
        """Whether the service answers ``GET /health`` with 200, in one attempt."""
        try:
            return (await self._http.get(HEALTH_PATH)).status_code == 200
        except httpx.HTTPError:
            return False

    async def register_rank(self, registration: RankRegistration,
                            sign: Callable[[bytes], Mapping[str, str]] | None = None) -> None:
        """Register a source rank (``sign``: the headers that sign its body, :mod:`meshwire.rank_proof`);
        :class:`BootstrapRefused` with the service's text when refused."""
        body = registration.wire()
        _check_ok(await self._call("PUT", content=body,
                                   headers={"content-type": "application/json", **(sign(body) if sign else {})}))

    async def get_sizes(self, *, wait_s: float = 0.0) -> PrefillInfo:
        """The node's sizes; with ``wait_s``, wait that long for a first registration."""
        patience = _Patience(self.retry, wait_s)
        while True:
            answer = await self._call("GET", params=_lookup_params(SIZES_QUERY, SIZES_QUERY))
            info = _parse(PrefillInfo, answer)
            if info.registered or patience.spent():
                return info
            await patience.pause()

    async def lookup_rank(self, engine_rank: int, dp_group: int, *, wait_s: float = 0.0) -> RankAddress:
        """The address of TP rank ``engine_rank`` of DP group ``dp_group``.

        Raises :class:`RankNotRegistered` when none is registered there, after
        waiting up to ``wait_s`` for one.
        """
        patience = _Patience(self.retry, wait_s)
        while True:
            try:
                answer = await self._call("GET", params=_lookup_params(engine_rank, dp_group))
                return _parse(RankAddress, answer)
            except RankNotRegistered:
                if patience.spent():
                    raise
            await patience.pause()

    async def _call(self, method: str, **request: Any) -> _Answer:
        failure: Exception | None = None
        for pause in self.retry.pauses():
            await asyncio.sleep(pause)
            try:
                answer = await self._attempt(method, **request)
            except httpx.TransportError as error:
                failure = error
                continue
            if answer.status not in RETRY_STATUSES:
                return answer
            failure = BootstrapRefused(answer.status, answer.text())
        raise BootstrapUnavailable(
            f"bootstrap at {self.base_url} failed {self.retry.attempts} attempts: {failure!r}") from failure

    async def _attempt(self, method: str, **request: Any) -> _Answer:
        async with self._http.stream(method, ROUTE_PATH, **request) as response:
            body = bytearray()
            chunks: AsyncIterator[bytes] = response.aiter_bytes()
            async for chunk in chunks:
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise _too_large()
            return _Answer(response.status_code, bytes(body))

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
