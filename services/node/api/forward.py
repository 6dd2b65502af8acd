"""``POST /forward``: run this node's layers on a frame and pass the result along the route.

The order of checks is the security model:

1. the sender's credential, before anything else is read: the proof headers
   of :mod:`meshwire.hop_proof` (``X-Meshnet-Signer``, ``X-Meshnet-Proof``),
   401 when missing or malformed; a node that holds no join token (a mesh of
   one shared secret) also takes ``Authorization: Bearer <MESHNET_SECRET>``
   in their place, as before;
2. every header, read once before the body (:func:`meshwire.forward_step.parse_forward`):
   400 with the :class:`~meshwire.frames.FrameError` code;
3. the signed route (``X-Meshnet-Route``): it must verify with the tracker's
   key, name this node at ``X-Meshnet-Hop-Index`` and agree with the layers it
   holds: 403 ``bad_route``; then the sender: the route's previous hop must be
   the signer, and the proof must verify with the hop key the route names for
   it, over these headers and this body: 403 ``bad_proof``; then the body:
   400 when it does not match its headers;
4. the session: step order (409 ``bad_step``), position (409 ``bad_position``),
   unknown session (409 ``unknown_session``), KV budget (503 ``kv_budget``
   with ``Retry-After``).

Nothing is changed before every check passed, so a refused frame leaves every
session as it was. Then the layers run on the compute worker; the tail samples;
any other hop sends the result to the next hop and answers with what comes
back (a 502 ``hop_failed`` naming the node that failed when the rest of the
route breaks). A close frame (``X-Meshnet-Control: close``, no body) frees the
session here and is passed on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import orjson
from starlette.requests import Request
from starlette.responses import Response

from meshwire import errors
from meshwire import headers as h
from meshwire.auth import check_bearer
from meshwire.body_guard import BodyIncomplete, BodyTooLarge, read_bounded
from meshwire.fork import FORK_REFUSED, ForkSource
from meshwire.forward_step import (
    CloseRequest,
    DataRequest,
    HopAddress,
    StepInfo,
    close_headers,
    parse_forward,
)
from meshwire.frames import FrameError, FrameLimits, body_bound, decode_frame_body
from meshwire.hop_proof import Claim, ProofProblem, check_claim, read_claim
from meshwire.kv_handoff import HANDOFF_FAILED
from meshwire.route_keys import KeyProblem, public_key_from_text
from meshwire.row_batch import MAX_INDEX_BYTES, RowAnswer, decode_rows, encode_answers
from meshwire.sampling_params import SamplingParams
from services.node.engine.compute import ShardRunner
from services.node.engine.sessions import (
    Session,
    SessionExists,
    SessionRefused,
    SessionTable,
    log_tag,
    route_key,
)
from services.node.hop.hop_client import INVALID_SAMPLING, ChainFailure, HopClient, send_along
from services.node.hop.route_step import Onward, RouteStepper
from services.node.hop.routing import RoutedHop, RouteRefused, verify_hop
from services.node.hop.trust import RouteTrust
from services.node.metrics import NodeMetrics
from services.node.pd.handoff_limits import HandoffLimits
from services.node.pd.kv_pull import HandoffFailed, KvPuller
from services.node.sampling.grammar import GrammarEngine, GrammarError
from services.node.sampling.sampler import Sampler, SamplingFailed

logger = logging.getLogger(__name__)

JSON: Final = "application/json"
BodyReader = Callable[[int], Awaitable[bytes]]
"""Reads a frame's body, refusing (``too_large``) one longer than the bytes given."""
FORWARD_PATH: Final = "/forward"
ROWS_PATH: Final = "/forward/rows"
_ERROR_TYPES: Final = {
    400: errors.INVALID_REQUEST, 401: errors.AUTHENTICATION, 403: errors.PERMISSION,
    409: errors.INVALID_REQUEST, 500: errors.SERVER_ERROR, 502: errors.SERVER_ERROR, 503: errors.UNAVAILABLE,
}


class ForwardRefusal(Exception):
    """A frame is refused with ``status`` and error ``code``; nothing was changed."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after


def _answer(status: int, body: dict[str, Any], retry_after: str | None = None) -> RowAnswer:
    """What one frame is answered, built by this module (so not validated again)."""
    return RowAnswer.model_construct(status=status, body=body, retry_after=retry_after)


def _response(answer: RowAnswer) -> Response:
    """One frame's answer as the ``POST /forward`` response (JSON, with ``Retry-After`` when it has one)."""
    headers = None if answer.retry_after is None else {"Retry-After": answer.retry_after}
    return Response(orjson.dumps(answer.body), status_code=answer.status, media_type=JSON, headers=headers)


class ForwardService:
    """The ``/forward`` endpoint of one node."""

    def __init__(self, *, node_id: str, model_id: str, trust: RouteTrust, legacy_secret: str | None,
                 runner: ShardRunner, sessions: SessionTable, hops: HopClient, stepper: RouteStepper,
                 metrics: NodeMetrics, frame_limits: FrameLimits, grammar: GrammarEngine | None = None,
                 puller: KvPuller | None = None, handoff_limits: HandoffLimits | None = None) -> None:
        self.node_id = node_id
        self.model_id = model_id
        self._trust = trust
        self._legacy_secret = legacy_secret
        self._runner = runner
        self._sessions = sessions
        self._hops = hops
        self._metrics = metrics
        self._limits = frame_limits
        self._stepper = stepper
        self._grammar = grammar
        self._puller = puller
        self._handoff_limits = handoff_limits

    # --- entry point ---------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """Answer one ``POST /forward``."""
        began = time.perf_counter()
        sender = self._check_credential(request, FORWARD_PATH)
        if isinstance(sender, RowAnswer):
            return _response(sender)
        answer = await self._frame(request.headers, lambda max_bytes: self._read_body(request, max_bytes), sender)
        if answer.status == 200:
            self._metrics.forward_latency.observe(time.perf_counter() - began)
        return _response(answer)

    async def handle_rows(self, request: Request) -> Response:
        """Answer one ``POST /forward/rows``: every frame of the batch as ``/forward`` would, side by side.

        The rows run concurrently, so their steps reach the step engine together
        and run as one batch; each row's answer is its own.
        """
        began = time.perf_counter()
        sender = self._check_credential(request, ROWS_PATH)
        if isinstance(sender, RowAnswer):
            return _response(sender)
        try:
            body = await self._read_body(request, self._limits.max_bytes + MAX_INDEX_BYTES)
            frames = decode_rows(body)
        except FrameError as exc:
            return _response(self._refuse(ForwardRefusal(400, exc.code, str(exc))))
        if sender is not None:  # one proof covers the whole batch: every row's route must vouch for its signer
            sender = sender.with_body(body)
        answers = await asyncio.gather(*(self._frame(frame.headers, _given(frame.body), sender) for frame in frames))
        self._metrics.forward_latency.observe(time.perf_counter() - began)
        return Response(encode_answers(answers), media_type=JSON)

    def _check_credential(self, request: Request, path: str) -> Sender | RowAnswer | None:
        """The sender's proof to check once the route is known, ``None`` for the legacy secret, or the refusal."""
        has_proof = any(name in request.headers for name in ("x-meshnet-signer", "x-meshnet-proof"))
        if not has_proof and self._legacy_secret is not None and request.headers.get("authorization"):
            failure = check_bearer(request.headers.get("authorization"), self._legacy_secret)
            if failure is None:
                return None
            return self._refuse(ForwardRefusal(failure.status, failure.code, failure.message))
        try:
            claim = read_claim(request.headers)
        except ProofProblem as exc:
            code = "unauthorized" if exc.status == 401 else "bad_proof"
            return self._refuse(ForwardRefusal(exc.status, code, str(exc)))
        return Sender(claim=claim, path=path, headers=request.headers, body=None)

    async def _frame(self, headers: Mapping[str, str], read_body: BodyReader, sender: Sender | None) -> RowAnswer:
        """One frame, after the credential: its route, then a close or a data frame; every refusal answered."""
        try:
            request = parse_forward(headers, self._limits)
            await self._trust.ensure(request.address.route_token or None)
            hop = self._verify_route(request.address, request.session)
            if sender is not None:
                sender.check_route(hop, closing=isinstance(request, CloseRequest))
            if isinstance(request, CloseRequest):
                if sender is not None:
                    sender.check_body(b"")
                return await self._close(request.session, hop)
            return await self._data_frame(request, headers, read_body, hop, sender)
        except FrameError as exc:
            return self._refuse(ForwardRefusal(400, exc.code, str(exc)))
        except ForwardRefusal as exc:
            return self._refuse(exc)
        except ChainFailure as exc:
            self._metrics.frames_refused.labels(code=str(exc.body.get("error", {}).get("code"))).inc()
            return _answer(exc.status, exc.body, exc.retry_after or None)

    def _refuse(self, refusal: ForwardRefusal) -> RowAnswer:
        self._metrics.frames_refused.labels(code=refusal.code).inc()
        logger.info("refused a frame: %d %s: %s", refusal.status, refusal.code, refusal)
        body = errors.error_body(str(refusal), _ERROR_TYPES.get(refusal.status, errors.INVALID_REQUEST),
                                 refusal.code, node_id=self.node_id)
        return _answer(refusal.status, body, None if refusal.retry_after is None else str(refusal.retry_after))

    # --- route ------------------------------------------------------------------------

    def _verify_route(self, address: HopAddress, session_id: str) -> RoutedHop:
        """The verified route naming this node at the frame's hop index, or a 403 ``bad_route``.

        A route's expiry bounds when a session may open; an open session's later
        frames ride on the route that opened it.
        """
        opens_session = self._sessions.get(session_id) is None
        try:
            hop = verify_hop(address.route_token or None, address.hop_index, keys=self._trust.keys,
                             node_id=self.node_id, model_id=self.model_id, shard=self._runner.shard,
                             check_expiry=opens_session)
        except RouteRefused as exc:
            raise ForwardRefusal(403, "bad_route", str(exc)) from None
        if address.start_layer != hop.me.start_layer:
            raise FrameError("bad_header", f"{h.START_LAYER} is {address.start_layer}, "
                                           f"the route says {hop.me.start_layer}")
        return hop

    # --- close ------------------------------------------------------------------------

    async def _close(self, session_id: str, hop: RoutedHop) -> RowAnswer:
        closed = await self.close_local(session_id, hop.token)
        nxt = hop.next
        if nxt is not None:
            try:
                await send_along(self._hops, nxt, close_headers(session_id, hop.token, hop.hop_index + 1,
                                                                nxt.start_layer), b"")
            except ChainFailure as exc:  # the session there expires on its own
                logger.info("could not pass the close of %s on to %s: %s", log_tag(session_id), nxt.node_id, exc)
        return _answer(200, {"token": None, "closed": closed, "node_timings_ms": {}})

    async def close_local(self, session_id: str, route_token: str) -> bool:
        """Free ``session_id`` on this node once its step in flight (if any) is done.

        Only the route that opened the session may close it (403 ``bad_route`` otherwise).
        """
        session = self._sessions.get(session_id)
        if session is None:
            return False
        _check_bound(session, route_token)
        async with session.lock:
            return self._sessions.close(session_id)

    # --- data frames ------------------------------------------------------------------

    async def _data_frame(self, request: DataRequest, headers: Mapping[str, str], read_body: BodyReader,
                          hop: RoutedHop, sender: Sender | None) -> RowAnswer:
        shard = self._runner.shard
        if hop.hop_index == 0:
            raise FrameError("bad_header", f"{h.HOP_INDEX} 0 is the head, which takes tokens through the chat API, "
                                           "not hidden states")
        spec, info, tokens = request.spec, request.info, request.tokens
        if spec.shape[2] != shard.hidden_size:
            raise FrameError("bad_shape", f"frame shape {list(spec.shape)} is not [1, n, {shard.hidden_size}] "
                                          "(this model's hidden size)")
        body = await read_body(body_bound(spec))
        if sender is not None:
            sender.check_body(body)
        frame = decode_frame_body(spec, headers, body)
        samples = shard.is_tail and frame.chunk_index == frame.chunk_total - 1
        params = info.sampling_params() if samples else None
        if params is not None and params.grammar is not None:
            if self._grammar is None:
                raise FrameError("bad_header", "this node enforces no grammars")
            if not self._grammar.ready:  # built once, off the event loop (about a second)
                await asyncio.to_thread(self._grammar.prepare)

        session = self._sessions.get(frame.session)
        if session is None:
            session = self._open(frame.session, info, tokens, hop.token)
        else:
            _check_bound(session, hop.token)
        async with session.lock:
            if info.handoff is not None and info.step == 0 and session.position == 0 and not session.closed:
                await self._take_over(session, info, hop.token)
            if info.fork is not None and info.step == 0 and session.position == 0 and not session.closed:
                self._fork(session, info.fork, hop.token)
            self._check_order(session, info)
            if info.sample_ids and shard.is_tail and session.sampler is None:
                if len(session.replayed_ids) + len(info.sample_ids) > (info.sample_draws or 0):
                    raise FrameError("bad_header", f"{h.SAMPLE_IDS} names more tokens than {h.SAMPLE_DRAWS}")
                session.replayed_ids.extend(info.sample_ids)
            sampler = await self._sampler(session, params, info) if samples else None
            nxt = hop.next
            onward = None if nxt is None else Onward(nxt, info.for_next_hop(nxt.start_layer), frame.chunk_index,
                                                     frame.chunk_total)
            try:
                done = await self._stepper.run(session, position_offset=info.position_offset,
                                               from_layer=info.start_layer, tokens=tokens, hidden=frame.tensor,
                                               sampler=sampler, onward=onward, score=info.score, draft=info.draft)
            except SessionRefused as exc:  # nothing was run: the session stays as it was
                raise ForwardRefusal(503, exc.code, str(exc), exc.retry_after_s) from None
            except SamplingFailed as exc:  # the request's parameters, not this node: no failure to report
                self._sessions.close(frame.session)
                raise ForwardRefusal(400, INVALID_SAMPLING, str(exc)) from None
            except ChainFailure:  # the rest of the route failed: this hop's step is done, the head decides
                self._stepped(session, tokens)
                raise
            except Exception:
                logger.exception("layers failed on session %s; closing it", log_tag(frame.session))
                self._sessions.close(frame.session)
                raise ForwardRefusal(500, "compute_failed", "this node failed to run its layers; "
                                                            "the session is closed") from None
            self._stepped(session, tokens)
            if info.hold is not None and frame.chunk_index == frame.chunk_total - 1:
                self._sessions.hold(session)
                self._metrics.handoffs_held.inc()
            body: dict[str, Any] = {"token": done.token, "node_timings_ms": done.node_timings_ms}
            if done.logprobs is not None:
                body["logprobs"] = done.logprobs.model_dump()
            if done.scored:
                body["scored"] = [item.model_dump() for item in done.scored]
            if done.run is not None:
                body["tokens"] = [pick.token for pick in done.run]
                if all(pick.logprobs is not None for pick in done.run):
                    body["run_logprobs"] = [pick.logprobs.model_dump() for pick in done.run if pick.logprobs]
                if done.unverified:
                    body["unverified"] = True
            return _answer(200, body)

    async def _take_over(self, session: Session, info: StepInfo, route_token: str) -> None:
        """Pull this hop's layers of a handoff's KV into the fresh ``session``; 409 ``handoff_failed`` if it cannot.

        A refused handoff closes the session here: the head opens a new one and prefills along the same route.
        """
        assert info.handoff is not None
        shard = self._runner.shard
        if self._puller is None:
            self._sessions.close(session.session_id)
            raise ForwardRefusal(409, HANDOFF_FAILED, f"node {self.node_id} has no bootstrap registry "
                                                      "(MESHNET_BOOTSTRAP) to find a handoff's KV with")
        try:
            await self._puller.pull_into(session.cache, info.handoff, info.start_layer, shard.end,  # type: ignore[arg-type]
                                         shard.device, route_token)
        except HandoffFailed as exc:
            self._sessions.close(session.session_id)
            logger.warning("node %s could not take the handoff of %s over (%s): %s", self.node_id,
                           log_tag(session.session_id), exc.reason, exc)
            raise ForwardRefusal(409, HANDOFF_FAILED, f"node {self.node_id}: {exc}") from None

    def _fork(self, session: Session, fork: ForkSource, route_token: str) -> None:
        """Start the fresh ``session`` with the first rows of ``fork``'s source session; 409 ``fork_refused``
        (the session closed here) when the source is not open here, was opened by another route, or is short.

        The rows below the source's prompt never change once written (later steps only append, and a
        rejected draft is cut back no further than the prompt), so they are read without its lock.
        """
        source = self._sessions.get(fork.session)
        problem = None
        if source is None or source.closed:
            problem = "is not open on this node"
        elif source.route_key is None or source.route_key != route_key(route_token):
            problem = "was opened along another route"
        elif source.position < fork.positions:
            problem = f"holds {source.position} positions, not {fork.positions}"
        if problem is None:
            assert source is not None
            try:
                session.cache.copy_prefix(source.cache, fork.positions)  # type: ignore[attr-defined]
            except ValueError as exc:
                problem = f"cannot be copied ({exc})"
        if problem is not None:
            self._sessions.close(session.session_id)
            self._metrics.forks.labels(outcome="refused").inc()
            raise ForwardRefusal(409, FORK_REFUSED, f"node {self.node_id} cannot fork session "
                                                    f"{log_tag(fork.session)}: it {problem}")
        self._metrics.forks.labels(outcome="forked").inc()
        self._metrics.fork_positions.inc(fork.positions)

    def _stepped(self, session: Session, tokens: int) -> None:
        """``session`` took its step on this node (whatever became of it further down the route)."""
        session.next_step += 1
        self._metrics.frame_tokens.observe(tokens)

    async def _read_body(self, request: Request, max_bytes: int) -> bytes:
        """The request body, refusing (``too_large``) one longer than ``max_bytes``."""
        try:
            return await read_bounded(request, max_bytes)
        except BodyTooLarge:
            raise FrameError("too_large", f"body is longer than the {max_bytes} bytes its headers announce") from None
        except BodyIncomplete:
            raise FrameError("bad_length", "the sender went away before the body was complete") from None

    def _open(self, session_id: str, info: StepInfo, tokens: int, route_token: str) -> Session:
        if info.step != 0:
            raise ForwardRefusal(409, "unknown_session", f"session {log_tag(session_id)} is not open on this node "
                                                         f"(closed, expired, or never opened); step {info.step}")
        start = 0 if info.handoff is None else info.handoff.positions
        if info.fork is not None:
            start = info.fork.positions
        if info.position_offset != start:
            raise ForwardRefusal(409, "bad_position", f"the first frame of session {log_tag(session_id)} must start at "
                                                      f"position {start}, not {info.position_offset}")
        reserve = max(info.reserve or 0, info.position_offset + tokens)
        try:
            if info.hold is not None and self._handoff_limits is not None:
                self._handoff_limits.check_room(self._sessions, reserve,
                                                  self._runner.shard.end - info.start_layer + 1)
            session = self._sessions.open(session_id, reserve, self._runner.new_cache(reserve), route_key(route_token))
            session.hold = info.hold is not None
            session.handoff_for = info.hold
            return session
        except SessionRefused as exc:
            raise ForwardRefusal(503, exc.code, str(exc), exc.retry_after_s) from None
        except SessionExists:  # another frame of the same session opened it meanwhile
            raise ForwardRefusal(409, "bad_step", f"session {log_tag(session_id)} is already open") from None

    def _check_order(self, session: Session, info: StepInfo) -> None:
        if session.closed:
            raise ForwardRefusal(409, "unknown_session", f"session {log_tag(session.session_id)} was closed")
        if info.step != session.next_step:
            raise ForwardRefusal(409, "bad_step", f"session {log_tag(session.session_id)} expects step {session.next_step}, "
                                                  f"got {info.step}")
        if info.position_offset != session.position:
            raise ForwardRefusal(409, "bad_position", f"session {log_tag(session.session_id)} holds {session.position} "
                                                      f"tokens; a frame at offset {info.position_offset} "
                                                      "does not follow them")

    async def _sampler(self, session: Session, params: SamplingParams | None, info: StepInfo) -> Sampler:
        if session.sampler is None:
            if params is None:
                raise FrameError("bad_header", f"the tail needs {h.SAMPLING} on the first frame that samples")
            constraint = None
            if params.grammar is not None:
                assert self._grammar is not None
                replayed = tuple(session.replayed_ids)
                if len(replayed) != (info.sample_draws or 0):
                    raise FrameError("bad_header", f"a grammar-constrained replay must carry every generated id in "
                                                   f"{h.SAMPLE_IDS}: {len(replayed)} of {info.sample_draws or 0}")
                try:
                    constraint = await asyncio.to_thread(self._grammar.constraint, params.grammar, replayed)
                except GrammarError as exc:
                    self._sessions.close(session.session_id)
                    raise ForwardRefusal(400, INVALID_SAMPLING, str(exc)) from None
                session.replayed_ids.clear()
            session.sampler = Sampler(params, constraint)
            if info.sample_draws:
                session.sampler.skip(info.sample_draws)
        return session.sampler


def _check_bound(session: Session, route_token: str) -> None:
    """Refuse (403 ``bad_route``) a frame for ``session`` that does not carry the route which opened it."""
    if session.route_key is not None and session.route_key != route_key(route_token):
        raise ForwardRefusal(403, "bad_route", f"session {log_tag(session.session_id)} was opened along another "
                                               "route; only that route may step or close it")


class Sender:
    """Who sent a request, as its proof claims, checked against each frame's route (:mod:`meshwire.hop_proof`).

    For ``/forward`` the proof covers the request's headers and its body, read
    later; for ``/forward/rows`` it covers the whole batch, known up front
    (:meth:`with_body`), and is verified once per hop key however many rows name it.
    """

    def __init__(self, *, claim: Claim, path: str, headers: Mapping[str, str], body: bytes | None) -> None:
        self.claim = claim
        self._path = path
        self._headers = headers
        self._body = body
        self._key_text: str | None = None
        self._verified: set[str] = set()

    def with_body(self, body: bytes) -> Sender:
        return Sender(claim=self.claim, path=self._path, headers=self._headers, body=body)

    def check_route(self, hop: RoutedHop, *, closing: bool = False) -> None:
        """Refuse (403 ``bad_proof``) a frame whose route does not name the signer as its previous hop.

        A close may also come from the route's head, which owns the session: after a hop
        fails, the head closes the session on the hops past it directly.
        """
        if hop.hop_index == 0:
            raise ForwardRefusal(403, "bad_proof", "hop 0 has no previous hop to send it frames")
        previous = hop.route.nodes[hop.hop_index - 1]
        if closing and previous.node_id != self.claim.signer and hop.route.head.node_id == self.claim.signer:
            previous = hop.route.head
        if previous.node_id != self.claim.signer:
            raise ForwardRefusal(403, "bad_proof", f"the route's previous hop is {previous.node_id}, but the frame "
                                                   f"is signed by {self.claim.signer[:100]}")
        if previous.hop_key is None:
            raise ForwardRefusal(403, "bad_proof", f"the route names no hop key for {previous.node_id}")
        self._key_text = previous.hop_key
        if self._body is not None:
            self.check_body(self._body)

    def check_body(self, body: bytes) -> None:
        """Verify the proof over ``body`` with the key the route named (once per key for a batch)."""
        key_text = self._key_text
        assert key_text is not None, "check_route first"
        if self._body is not None:
            body = self._body
            if key_text in self._verified:
                return
        try:
            check_claim(self.claim, public_key_from_text(key_text), self._path, self._headers, body)
        except (ProofProblem, KeyProblem) as exc:
            raise ForwardRefusal(403, "bad_proof", str(exc)) from None
        self._verified.add(key_text)


def _given(body: bytes) -> BodyReader:
    """A body reader over a row's body already received (``POST /forward/rows``)."""
    async def read(max_bytes: int) -> bytes:
        if len(body) > max_bytes:
            raise FrameError("too_large", f"body is longer than the {max_bytes} bytes its headers announce")
        return body
    return read
