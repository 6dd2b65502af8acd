"""A prefill node's side of a handoff: ``POST /kv/prefill`` and ``POST /kv/pull``.

Both calls are signed with the caller's hop key and checked against the
tracker's signed routes (:mod:`services.node.pd.kv_auth`), not a shared secret.

``POST /kv/prefill`` (on the prefill route's head; from a decode route's
head): the signed prefill route naming this node first (``X-Meshnet-Route``),
the signed decode route the handoff is for (``X-Meshnet-Decode-Route``, whose
head signs the request), the handoff id (``X-Meshnet-Session``), the
request's sampling (``X-Meshnet-Sampling``) and ``{"ids": [...]}``. The
prompt runs along the prefill route in chunks, each hop keeping its KV for
that decode route (``X-Meshnet-Handoff-Hold``: the route's digest); the tail
samples the first token. The answer
(:class:`~meshwire.kv_handoff.PrefillAnswer`) names the positions held and the
route's DP group. A route that fails closes the session along it.

``POST /kv/pull`` (from decode nodes): signed by a node of the decode route it
carries (``X-Meshnet-Route``), the handoff id,
``X-Meshnet-KV-Layers: A-B`` (layers this node holds of the handoff, within
the signer's layers on the decode route), ``X-Meshnet-Chunk-Index`` and
``X-Meshnet-KV-Chunk-Positions`` (whole pages, at most the node's frame limit
in bytes). The answer is one frame ``[2 * layers, kv_heads, positions,
head_dim]`` with ``X-Meshnet-Chunk-Total`` and ``X-Meshnet-KV-Positions``.
Once every layer this node holds of the handoff was pulled to its last chunk,
the handoff is freed; one never pulled whole is freed after
``MESHNET_HANDOFF_TTL_S``. A pull names the node it is for
(``X-Meshnet-KV-Source``; another node's is refused 403 ``wrong_node``), and
every answer is signed with this node's hop key over its headers, its bytes,
the puller and the pull's proof (:func:`~meshwire.kv_handoff.sign_pull_answer`),
so the decode node takes KV only from the node the signed prefill route names.
The chunk itself is sealed to the puller's fresh X25519 key
(``X-Meshnet-KV-Box``, :mod:`meshwire.kv_box`): a pull without one is refused
400, and a pull replayed by anyone else yields bytes only the puller can open.

Refusals are OpenAI-shaped JSON: 401 without a proof, 403
``bad_proof``/``bad_route``/``bad_layers``/``replayed`` for a proof or route
that does not allow the call (the proof checked from the headers, before the
body is read: it signs the body's digest), 400 for a bad header or
body, 404 ``unknown_handoff``, 409 ``not_prefill`` (a node that is not a member
of a registered prefill group), 503 when the node is at its handoff bounds.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from typing import Final, Protocol

import orjson
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from meshwire import errors
from meshwire import headers as h
from meshwire.body_guard import BodyIncomplete, BodyTooLarge, read_bounded
from meshwire.frames import FrameError, check_session_id, encode_frame, get_header, parse_int_header
from meshwire.hop_proof import PROOF
from meshwire.kv_box import BOX, BoxProblem, check_box, seal
from meshwire.kv_handoff import (
    KV_CHUNK_POSITIONS,
    KV_LAYERS,
    KV_POSITIONS,
    PAGE_TOKENS,
    UNKNOWN_HANDOFF,
    KVShape,
    PrefillAnswer,
    PrefillRequest,
    format_layers,
    parse_layers,
    sign_pull_answer,
)
from meshwire.route_keys import SigningKey
from meshwire.sampling_params import SamplingParams
from services.node.engine.compute import ShardRunner
from services.node.engine.sessions import SessionRefused, SessionTable, log_tag
from services.node.head.failures import GenerationFailed
from services.node.hop.auth import HopAuth
from services.node.hop.routing import RoutedHop, RouteRefused, verify_hop
from services.node.metrics import NodeMetrics
from services.node.pd.handoff_limits import HandoffLimits
from services.node.pd.kv_auth import HandoffAuth, KvRefusal, caller_claim, check_pull_target
from services.node.pd.kv_transfer import KVTransferError, read_kv
from services.node.pd.pd_member import PrefillMembership
from services.node.sampling.sampler import Pick

logger = logging.getLogger(__name__)

JSON: Final = "application/json"
OCTET_STREAM: Final = "application/octet-stream"
MAX_PREFILL_BODY_BYTES: Final = 8 * 1024 * 1024
"""Largest ``/kv/prefill`` body read (token ids as JSON)."""
MAX_CHUNK_INDEX: Final = 1 << 20


def _error(status: int, code: str, message: str, node_id: str) -> Response:
    kind = {400: errors.INVALID_REQUEST, 401: errors.AUTHENTICATION, 403: errors.PERMISSION,
            404: errors.NOT_FOUND, 409: errors.INVALID_REQUEST, 503: errors.UNAVAILABLE}.get(status,
                                                                                            errors.SERVER_ERROR)
    return Response(orjson.dumps(errors.error_body(message, kind, code, node_id=node_id)), status_code=status,
                    media_type=JSON, headers={"Retry-After": "2"} if status == 503 else None)


class HeldPrefill(Protocol):
    """One handoff's session along the prefill route (:class:`services.node.head.chain.SessionChain` is one)."""

    async def step(self, ids: Sequence[int], *, chunk_index: int = 0,
                   chunk_total: int = 1) -> tuple[Pick, ...] | None:
        """Run a chunk of the prompt along the route; the first token on the last chunk."""

    async def close(self, failed_node: str | None = None) -> None:
        """Free the session here and along the route (past ``failed_node`` too)."""


class PrefillChains(Protocol):
    """Opens a handoff's session along the prefill route (:class:`services.node.head.chain.ChainOpener` does)."""

    def open(self, hop: RoutedHop, *, session_id: str, sampling: SamplingParams, reserve: int,
             hold: str) -> HeldPrefill:
        """A session ``session_id`` along ``hop``'s route whose every hop holds the prompt's KV for ``hold``."""


class KvServeService:
    """The handoff endpoints of one prefill node."""

    def __init__(self, *, node_id: str, model_id: str, auth: HopAuth, hop_key: SigningKey, runner: ShardRunner,
                 sessions: SessionTable, chains: PrefillChains, metrics: NodeMetrics, membership: PrefillMembership,
                 shape: KVShape, limits: HandoffLimits, max_chunk_bytes: int, prefill_chunk_tokens: int,
                 max_prompt_tokens: int) -> None:
        self.node_id = node_id
        self.model_id = model_id
        self._front = auth
        self._hop_key = hop_key
        self._auth = HandoffAuth(auth=auth)
        self._runner = runner
        self._sessions = sessions
        self._chains = chains
        self._metrics = metrics
        self._membership = membership
        self._shape = shape
        self._limits = limits
        self._max_chunk_bytes = max_chunk_bytes
        self._chunk = prefill_chunk_tokens
        self._max_prompt = max_prompt_tokens

    # --- POST /kv/prefill --------------------------------------------------------------

    async def handle_prefill(self, request: Request) -> Response:
        try:
            return await self._prefill(request)
        except KvRefusal as exc:
            logger.info("refused a prefill: %d %s: %s", exc.status, exc.code, exc)
            return _error(exc.status, exc.code, str(exc), self.node_id)
        except FrameError as exc:
            return _error(400, exc.code, str(exc), self.node_id)

    async def _prefill(self, request: Request) -> Response:
        claim = caller_claim(request.headers)
        place = self._membership.assignment
        if place is None or self._membership.pd_rank is None:
            raise KvRefusal(409, "not_prefill", f"node {self.node_id} is not a registered member of a prefill group")
        shard = self._runner.shard
        token = request.headers.get(h.ROUTE)
        trust = self._front.trust
        try:
            await trust.ensure(token)
            hop = verify_hop(token, 0, keys=trust.keys, node_id=self.node_id, model_id=self.model_id, shard=shard,
                             revoked=trust.revoked)
        except RouteRefused as exc:
            raise KvRefusal(403, "bad_route", str(exc)) from None
        digest, credential = await self._auth.check_prefill(claim, request.headers)  # before the body is read
        try:
            body = await read_bounded(request, MAX_PREFILL_BODY_BYTES)
        except (BodyTooLarge, BodyIncomplete):
            raise KvRefusal(400, "bad_body", f"the body is incomplete or over {MAX_PREFILL_BODY_BYTES} bytes") from None
        credential.check_body(body)
        session_id = check_session_id(get_header(request.headers, h.SESSION))
        try:
            sampling = SamplingParams.model_validate_json(get_header(request.headers, h.SAMPLING) or "")
        except ValidationError as exc:
            raise KvRefusal(400, "bad_header", f"{h.SAMPLING} is not sampling parameters: "
                                               f"{exc.errors()[0]['msg']}") from None
        try:
            ids = PrefillRequest.model_validate_json(body).ids
        except ValidationError as exc:
            raise KvRefusal(400, "bad_body", f"the body is not {{\"ids\": [token, ...]}}: "
                                             f"{exc.errors()[0]['msg']}") from None
        if len(ids) > self._max_prompt:
            raise KvRefusal(400, "context_length_exceeded", f"{len(ids)} tokens, over this node's limit of "
                                                            f"{self._max_prompt}")
        if any(not 0 <= token < shard.vocab_size for token in ids):
            raise KvRefusal(400, "bad_body", f"a token id is outside the vocabulary of {shard.vocab_size}")
        if self._sessions.get(session_id) is not None:
            raise KvRefusal(409, "bad_step", f"handoff {log_tag(session_id)} already exists")
        try:
            self._limits.check_room(self._sessions, len(ids), shard.end - shard.start + 1)
        except SessionRefused as exc:
            raise KvRefusal(503, exc.code, str(exc)) from None
        chain = self._chains.open(hop, session_id=session_id, sampling=sampling, reserve=len(ids), hold=digest)
        pick = await self._run_prompt(chain, ids)
        session = self._sessions.get(session_id)
        if pick is None or session is None:
            await chain.close()
            raise KvRefusal(502, "no_token", "the prefill route produced no token")
        self._sessions.hold(session)
        self._metrics.handoffs_held.inc()
        answer = PrefillAnswer(token=pick.token, positions=len(ids), dp_group=place.dp_group, logprobs=pick.logprobs)
        return Response(answer.model_dump_json(exclude_none=True), media_type=JSON)

    async def _run_prompt(self, chain: HeldPrefill, ids: list[int]) -> Pick | None:
        """Run the prompt along the prefill route in chunks; the first token. A route that fails (or a request
        cancelled) closes the session along it."""
        chunks = [ids[i:i + self._chunk] for i in range(0, len(ids), self._chunk)]
        pick = None
        try:
            for index, chunk in enumerate(chunks):
                picks = await chain.step(chunk, chunk_index=index, chunk_total=len(chunks))
                pick = picks[0] if picks else None
        except GenerationFailed as exc:
            await asyncio.shield(chain.close(exc.failed_node))
            raise KvRefusal(exc.status if exc.status != 409 else 502, exc.code, str(exc)) from None
        except BaseException:
            await asyncio.shield(chain.close())
            raise
        return pick

    # --- POST /kv/pull --------------------------------------------------------------------

    async def handle_pull(self, request: Request) -> Response:
        try:
            return await self._pull(request)
        except KvRefusal as exc:
            return _error(exc.status, exc.code, str(exc), self.node_id)
        except FrameError as exc:
            return _error(400, exc.code, str(exc), self.node_id)

    async def _pull(self, request: Request) -> Response:
        headers = request.headers
        claim = caller_claim(headers)
        digest, signer = await self._auth.signed_puller(claim, headers)
        check_pull_target(headers, self.node_id)
        try:
            check_box(headers.get(BOX))
        except BoxProblem as exc:
            raise KvRefusal(400, "bad_header", str(exc)) from None
        session_id = check_session_id(get_header(headers, h.SESSION))
        first, last = parse_layers(get_header(headers, KV_LAYERS))
        index = parse_int_header(h.CHUNK_INDEX, get_header(headers, h.CHUNK_INDEX), minimum=0,
                                 maximum=MAX_CHUNK_INDEX)
        per_chunk = parse_int_header(KV_CHUNK_POSITIONS, get_header(headers, KV_CHUNK_POSITIONS),
                                     minimum=PAGE_TOKENS, maximum=1 << 24)
        if per_chunk % PAGE_TOKENS:
            raise KvRefusal(400, "bad_header", f"{KV_CHUNK_POSITIONS} must be whole pages of {PAGE_TOKENS}")
        chunk_bytes = per_chunk * (last - first + 1) * self._shape.position_bytes_per_layer
        if chunk_bytes > self._max_chunk_bytes:
            raise KvRefusal(400, "too_large", f"a chunk of {per_chunk} positions of layers {first}-{last} is "
                                              f"{chunk_bytes} bytes, over this node's {self._max_chunk_bytes}")
        session = self._sessions.get(session_id)
        if session is None or session.held_until is None:
            raise KvRefusal(404, UNKNOWN_HANDOFF, f"node {self.node_id} holds no handoff {log_tag(session_id)} "
                                                  "(never held, already pulled, or expired)")
        self._auth.check_pull(claim, digest, signer, session, first, last)
        async with session.lock:
            if session.closed:
                raise KvRefusal(404, UNKNOWN_HANDOFF, f"handoff {log_tag(session_id)} was freed")
            entry = session.cache.entry_layer  # type: ignore[attr-defined]
            shard = self._runner.shard
            if entry is None or first < entry or last > shard.end:
                raise KvRefusal(400, "bad_layers", f"node {self.node_id} holds layers {entry}-{shard.end} of this "
                                                   f"handoff, not {first}-{last}")
            positions = session.position
            total = math.ceil(positions / per_chunk)
            if index >= total:
                raise KvRefusal(400, "bad_header", f"chunk {index} of {total}")
            start, end = index * per_chunk, min(positions, (index + 1) * per_chunk)
            try:
                tensor = await asyncio.to_thread(read_kv, session.cache, first, last, start, end)  # type: ignore[arg-type]
            except KVTransferError as exc:
                raise KvRefusal(409, "bad_layers", str(exc)) from None
            out_headers, body = encode_frame(tensor, session=session_id, chunk_index=index, chunk_total=total,
                                             extra={KV_POSITIONS: str(positions),
                                                    KV_LAYERS: format_layers(first, last)})
            self._metrics.kv_served_bytes.inc(len(body))
            if index == total - 1:
                session.pulled_layers.update(range(first, last + 1))
                if session.pulled_layers >= set(range(entry, shard.end + 1)):
                    self._sessions.close(session_id)
                    self._metrics.handoffs_freed.labels(how="pulled").inc()
        body = await asyncio.to_thread(self._seal_and_sign, out_headers, body, claim.signer, headers.get(PROOF) or "",
                                       headers.get(BOX))
        return Response(body, media_type=OCTET_STREAM, headers=out_headers)

    def _seal_and_sign(self, out_headers: dict[str, str], body: bytes, requester: str, proof: str,
                       box: str | None) -> bytes:
        """Seal a chunk to the puller's key and sign the answer (adds both headers); the sealed bytes. Off the
        event loop: a chunk is megabytes to encrypt and hash."""
        out_headers[BOX], sealed = seal(box, body, proof)
        out_headers.update(sign_pull_answer(self._hop_key, self.node_id, out_headers, sealed, requester=requester,
                                            request_proof=proof))
        return sealed


