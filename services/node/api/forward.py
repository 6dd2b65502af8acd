"""``POST /forward``: run this node's layers on a frame and pass the result along the route.

The order of checks is the security model; the first three are
:mod:`services.node.hop.auth`'s, the node's one front door, and read no body:

1. the sender's credential: the proof headers of :mod:`meshwire.hop_proof`
   (``X-Meshnet-Signer``, ``X-Meshnet-Proof``, ``X-Meshnet-Body-Sha256``),
   401 when missing or malformed; a node that holds no join token (a mesh of
   one shared secret) also takes ``Authorization: Bearer <MESHNET_SECRET>``
   in their place, as before;
2. every header, read once (:func:`meshwire.forward_step.parse_forward`):
   400 with the :class:`~meshwire.frames.FrameError` code;
3. the signed route (``X-Meshnet-Route``): it must verify with the tracker's
   key, name this node at ``X-Meshnet-Hop-Index`` and agree with the layers it
   holds: 403 ``bad_route``; then the sender: the route's previous hop must be
   the signer, and the proof must verify with the hop key the route names for
   it, over these headers and the body's declared digest: 403 ``bad_proof``.
   Only then is the body read, within the bound its headers give, and it must
   hash to the signed digest (403 ``bad_proof``) and match its headers (400);
4. the session: step order (409 ``bad_step``), position (409 ``bad_position``),
   unknown session (409 ``unknown_session``), KV budget (503 ``kv_budget``
   with ``Retry-After``).

``POST /forward/rows`` names the route of one of its rows in its own headers,
so its proof too is verified before the batch is read; each row is then
checked as a ``/forward`` frame.

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
from meshwire.frames import Frame, FrameError, FrameLimits, body_bound, decode_frame_body, get_header
from meshwire.kv_handoff import HANDOFF_FAILED
from meshwire.receipts import RECEIPT, make_receipt, sha256_hex
from meshwire.route_keys import SigningKey
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
from services.node.hop.auth import Credential, HopAuth, HopRefused
from services.node.hop.hop_client import INVALID_SAMPLING, ChainFailure, HopClient, send_along
from services.node.hop.route_step import Onward, RouteStepper, StepDone
from services.node.hop.routing import RoutedHop
from services.node.metrics import NodeMetrics
from services.node.pd.handoff_limits import HandoffLimits
from services.node.pd.kv_pull import HandoffFailed, KvPuller
from services.node.sampling.grammar import GrammarEngine, GrammarError
from services.node.sampling.sampler import Sampler, SamplingFailed, check_replay_draws

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


def _response(answer: RowAnswer, receipt: str | None = None) -> Response:
    """One frame's answer as the ``POST /forward`` response (JSON, with ``Retry-After`` when it has one, and this
    hop's receipt when it ran the step)."""
    headers = {} if answer.retry_after is None else {"Retry-After": answer.retry_after}
    if receipt is not None:
        headers[RECEIPT] = receipt
    return Response(orjson.dumps(answer.body), status_code=answer.status, media_type=JSON, headers=headers)


class ForwardService:
    """The ``/forward`` endpoint of one node."""

    def __init__(self, *, node_id: str, model_id: str, auth: HopAuth,
                 runner: ShardRunner, sessions: SessionTable, hops: HopClient, stepper: RouteStepper,
                 metrics: NodeMetrics, frame_limits: FrameLimits, grammar: GrammarEngine | None = None,
                 puller: KvPuller | None = None, handoff_limits: HandoffLimits | None = None,
                 hop_key: SigningKey | None = None) -> None:
        self.node_id = node_id
        self.model_id = model_id
        self._auth = auth
        self._runner = runner
        self._sessions = sessions
        self._hops = hops
        self._metrics = metrics
        self._limits = frame_limits
        self._stepper = stepper
        self._grammar = grammar
        self._puller = puller
        self._handoff_limits = handoff_limits
        self._hop_key = hop_key
        """Signs this hop's receipt of each step it ran (:mod:`meshwire.receipts`); ``None``: no receipts."""

    # --- entry point ---------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        """Answer one ``POST /forward``."""
        began = time.perf_counter()
        try:
            credential = self._auth.credential(request.headers, FORWARD_PATH)
        except HopRefused as exc:
            return _response(self._refuse(ForwardRefusal(exc.status, exc.code, str(exc))))
        answer, receipt = await self._frame(request.headers, lambda max_bytes: self._read_body(request, max_bytes),
                                            credential)
        if answer.status == 200:
            self._metrics.forward_latency.observe(time.perf_counter() - began)
        return _response(answer, receipt)

    async def handle_rows(self, request: Request) -> Response:
        """Answer one ``POST /forward/rows``: every frame of the batch as ``/forward`` would, side by side.

        The batch's proof is verified from its headers before the batch is read
        (:meth:`HopAuth.batch`). The rows run concurrently, so their steps reach
        the step engine together and run as one batch; each row's answer is its own.
        """
        began = time.perf_counter()
        try:
            credential = await self._auth.batch(request.headers, ROWS_PATH)
            body = await self._read_body(request, self._limits.max_bytes + MAX_INDEX_BYTES)
            credential.check_body(body)  # one proof covers the whole batch
            frames = decode_rows(body)
        except HopRefused as exc:
            return _response(self._refuse(ForwardRefusal(exc.status, exc.code, str(exc))))
        except FrameError as exc:
            return _response(self._refuse(ForwardRefusal(400, exc.code, str(exc))))
        answers = await asyncio.gather(*(self._frame(frame.headers, _given(frame.body), credential)
                                         for frame in frames))
        self._metrics.forward_latency.observe(time.perf_counter() - began)
        return Response(encode_answers([answer for answer, _ in answers]), media_type=JSON)

    async def _frame(self, headers: Mapping[str, str], read_body: BodyReader,
                     credential: Credential) -> tuple[RowAnswer, str | None]:
        """One frame, after the credential's form: its route and sender, then a close or a data frame; every
        refusal answered. With the answer, this hop's receipt of a step it ran (``None`` otherwise)."""
        try:
            request = parse_forward(headers, self._limits)
            closing = isinstance(request, CloseRequest)
            hop = await self._route(request.address, request.session, credential, closing=closing)
            if isinstance(request, CloseRequest):
                credential.check_body(b"")
                return await self._close(request.session, hop), None
            return await self._data_frame(request, headers, read_body, hop, credential)
        except FrameError as exc:
            return self._refuse(ForwardRefusal(400, exc.code, str(exc))), None
        except HopRefused as exc:
            return self._refuse(ForwardRefusal(exc.status, exc.code, str(exc))), None
        except ForwardRefusal as exc:
            return self._refuse(exc), None
        except ChainFailure as exc:
            self._metrics.frames_refused.labels(code=str(exc.body.get("error", {}).get("code"))).inc()
            return _answer(exc.status, exc.body, exc.retry_after or None), None

    def _refuse(self, refusal: ForwardRefusal) -> RowAnswer:
        self._metrics.frames_refused.labels(code=refusal.code).inc()
        logger.info("refused a frame: %d %s: %s", refusal.status, refusal.code, refusal)
        body = errors.error_body(str(refusal), _ERROR_TYPES.get(refusal.status, errors.INVALID_REQUEST),
                                 refusal.code, node_id=self.node_id)
        return _answer(refusal.status, body, None if refusal.retry_after is None else str(refusal.retry_after))

    # --- route ------------------------------------------------------------------------

    async def _route(self, address: HopAddress, session_id: str, credential: Credential, *,
                     closing: bool) -> RoutedHop:
        """The verified route naming this node at the frame's hop index, sent by its previous hop
        (:meth:`HopAuth.frame`: 403 ``bad_route`` / ``bad_proof``), with the layers the frame says.

        A route's expiry bounds when a session may open; an open session's later
        frames ride on the route that opened it.
        """
        hop = await self._auth.frame(credential, address.route_token or None, address.hop_index,
                                     shard=self._runner.shard, opens_session=self._sessions.get(session_id) is None,
                                     closing=closing)
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
                          hop: RoutedHop, credential: Credential) -> tuple[RowAnswer, str | None]:
        """One data frame, its sender already verified: its body, its session, its step, its answer and receipt."""
        frame, input_sha256 = await self._received(request, headers, read_body, hop, credential)
        info, tokens = request.info, request.tokens
        samples = self._runner.shard.is_tail and frame.chunk_index == frame.chunk_total - 1
        params = await self._sampling(info, tokens) if samples else None
        session = self._session_for(frame.session, info, tokens, hop.token)
        async with session.lock:
            await self._begin(session, info, hop.token, shadow=hop.shadow)
            sampler = await self._sampler(session, params, info) if samples else None
            done = await self._step(session, info, frame, hop, sampler, tokens)
            self._stepped(session, tokens)
            if info.hold is not None and frame.chunk_index == frame.chunk_total - 1:
                self._sessions.hold(session)
                self._metrics.handoffs_held.inc()
            receipt = self._receipt(hop, frame.session, info, tokens, input_sha256, done)
            body = _step_body(done)
            if get_header(headers, h.RECEIPTS) == "chain":  # the sender knows receipts in the answer
                body = _with_receipts(body, receipt, done.receipts)
            return _answer(200, body), receipt

    def _receipt(self, hop: RoutedHop, session_id: str, info: StepInfo, tokens: int, input_sha256: str,
                 done: StepDone) -> str | None:
        """This hop's signed receipt of the step it ran (:mod:`meshwire.receipts`), one header line."""
        if self._hop_key is None or done.output_sha256 is None:
            return None
        return make_receipt(self._hop_key, route_token=hop.token, session=session_id, node_id=self.node_id,
                            hop_index=hop.hop_index, step=info.step, position_offset=info.position_offset,
                            positions=tokens, input_sha256=input_sha256, output_sha256=done.output_sha256).encode()

    async def _received(self, request: DataRequest, headers: Mapping[str, str], read_body: BodyReader,
                        hop: RoutedHop, credential: Credential) -> tuple[Frame, str]:
        """The frame's body, read within the bound its headers give, the one its proof signed, decoded; with the
        body's SHA-256 (this hop's input, as its receipt binds it)."""
        shard = self._runner.shard
        spec = request.spec
        if hop.hop_index == 0:
            if not hop.shadow:
                raise FrameError("bad_header", f"{h.HOP_INDEX} 0 is the head, which takes tokens through the chat "
                                               "API, not hidden states")
            if spec.shape[2] != 1 or spec.dtype != "float32":  # the head's shadow: the step's token ids
                raise FrameError("bad_shape", f"a head's shadow takes token ids, shape [1, n, 1] float32, not "
                                              f"{list(spec.shape)} {spec.dtype}")
            body = await read_body(body_bound(spec))
            credential.check_body(body)
            frame = decode_frame_body(spec, headers, body)
            values = frame.tensor.reshape(-1)
            if not bool(((values >= 0) & (values < shard.vocab_size) & (values == values.round())).all()):
                raise FrameError("bad_shape", "a head's shadow takes token ids of this model's vocabulary")
            return frame, sha256_hex(body)
        if spec.shape[2] != shard.hidden_size:
            raise FrameError("bad_shape", f"frame shape {list(spec.shape)} is not [1, n, {shard.hidden_size}] "
                                          "(this model's hidden size)")
        body = await read_body(body_bound(spec))
        credential.check_body(body)
        return decode_frame_body(spec, headers, body), sha256_hex(body)

    async def _sampling(self, info: StepInfo, tokens: int) -> SamplingParams | None:
        """The request's sampling parameters at the tail, its grammar engine made ready when it needs one;
        a replay's draws within what its positions can have made (checked before any session opens)."""
        if info.sample_draws:
            check_replay_draws(info.sample_draws, info.position_offset + tokens)
        params = info.sampling_params()
        if params is not None and params.grammar is not None:
            if self._grammar is None:
                raise FrameError("bad_header", "this node enforces no grammars")
            if not self._grammar.ready:  # built once, off the event loop (about a second)
                await asyncio.to_thread(self._grammar.prepare)
        return params

    def _session_for(self, session_id: str, info: StepInfo, tokens: int, route_token: str) -> Session:
        """The frame's session: opened by its first frame, else the one open here along the same route."""
        session = self._sessions.get(session_id)
        if session is None:
            return self._open(session_id, info, tokens, route_token)
        _check_bound(session, route_token)
        return session

    async def _begin(self, session: Session, info: StepInfo, route_token: str, *, shadow: bool = False) -> None:
        """Under the session's lock, before it steps: a handoff or fork to start from, the step's order,
        the replayed ids a replay brings to the tail."""
        fresh = info.step == 0 and session.position == 0 and not session.closed
        if info.handoff is not None and fresh:
            await self._take_over(session, info, route_token)
        if info.fork is not None and fresh:
            self._fork(session, info.fork, route_token)
        self._check_order(session, info, shadow=shadow)
        if info.sample_ids and self._runner.shard.is_tail and session.sampler is None:
            if len(session.replayed_ids) + len(info.sample_ids) > (info.sample_draws or 0):
                raise FrameError("bad_header", f"{h.SAMPLE_IDS} names more tokens than {h.SAMPLE_DRAWS}")
            session.replayed_ids.extend(info.sample_ids)

    async def _step(self, session: Session, info: StepInfo, frame: Frame, hop: RoutedHop, sampler: Sampler | None,
                    tokens: int) -> StepDone:
        """Run the layers (and sample, and send on); each failure answered as what it means for the session."""
        nxt = hop.next
        onward = None if nxt is None else Onward(nxt, info.for_next_hop(nxt.start_layer), frame.chunk_index,
                                                 frame.chunk_total, hop.next_shadow)
        try:
            ids = None if hop.hop_index != 0 else [int(v) for v in frame.tensor.reshape(-1).tolist()]
            return await self._stepper.run(session, position_offset=info.position_offset,
                                           from_layer=info.start_layer, tokens=tokens, ids=ids,
                                           hidden=None if ids is not None else frame.tensor,
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

    def _check_order(self, session: Session, info: StepInfo, *, shadow: bool = False) -> None:
        if session.closed:
            raise ForwardRefusal(409, "unknown_session", f"session {log_tag(session.session_id)} was closed")
        if info.step != session.next_step:
            raise ForwardRefusal(409, "bad_step", f"session {log_tag(session.session_id)} expects step {session.next_step}, "
                                                  f"got {info.step}")
        if shadow and info.position_offset < session.position:
            # A shadow (issue 37) gets no answer back from a next hop, so it never learns which drafted positions of a
            # speculative step the tail kept; the hop it shadows dropped the others' KV rows as the answer passed
            # back, and this frame starts where the kept run ended: drop them here too, and stay in step.
            session.cache.truncate(info.position_offset)
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


def _step_body(done: StepDone) -> dict[str, Any]:
    """A step's answer: the token (at the tail), timings, and what the step scored or verified."""
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
    return body


def _with_receipts(body: dict[str, Any], own: str | None, downstream: tuple[str, ...]) -> dict[str, Any]:
    """A step's answer with its chain of receipts: this hop's own, then those that came back from the hops after
    it (and a shadow's). Each row of a ``/forward/rows`` batch is a step of its own session along its own route,
    so each row carries its own receipt (one signature a row, tens of microseconds): a receipt over the whole
    batch would bind sessions of different routes together, and no head could show it for its own step alone."""
    chain = ([own] if own is not None else []) + list(downstream)
    if chain:
        body["receipts"] = chain
    return body


def _given(body: bytes) -> BodyReader:
    """A body reader over a row's body already received (``POST /forward/rows``)."""
    async def read(max_bytes: int) -> bytes:
        if len(body) > max_bytes:
            raise FrameError("too_large", f"body is longer than the {max_bytes} bytes its headers announce")
        return body
    return read
