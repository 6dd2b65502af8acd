"""A node's parts, built when it starts and torn down when it stops.

:meth:`NodeRuntime.start` resolves the model (converting the default one on
a first start, with progress in the log), asks the tracker which layers to hold
when started without ``--layers`` (after measuring what one layer costs here),
loads only this node's layers on
the chosen device and dtype, warms up (which also measures the decode rate
the tracker is told), then starts the idle sweeper and the registration.
:meth:`NodeRuntime.stop` stops taking sessions, deregisters, lets in-flight
closes finish and releases everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, cast

import httpx
import torch
from transformers import AutoConfig

try:  # written by the relay piece; without it a node is reached directly only
    from meshwire.relay_client import RelayPeer
except ImportError:  # pragma: no cover - depends on which pieces are installed
    RelayPeer = None  # type: ignore[assignment,misc]

from meshwire import tls
from meshwire.frames import DTYPE_NAMES, FrameLimits
from meshwire.placement import PlacementAnswer, PlacementReason, PlacementRequest
from meshwire.registry import Activations, NodeRegistration, RegistrationAnswer
from services.node.api.forward import ForwardService
from services.node.api.kv_serve import KvServeService
from services.node.engine.compute import ComputeWorker, ShardRunner, one_torch_thread
from services.node.engine.cpu_gate import cpu_gate_for
from services.node.engine.faults import FaultInjector
from services.node.engine.sessions import SessionTable, run_sweeper
from services.node.head.chain import ChainOpener
from services.node.head.draft_model import load_draft_model
from services.node.head.generation import Generator
from services.node.head.sampling_defaults import SamplingDefaults
from services.node.head.tokens import HeadTokenizer, eos_ids_of
from services.node.hop.auth import HopAuth
from services.node.hop.hop_client import HopClient
from services.node.hop.placement_client import PlacementRefused, ask_placement
from services.node.hop.receipt_report import ReceiptReporter
from services.node.hop.registration import Registrar
from services.node.hop.relay_link import ASGIApp, asgi_handler
from services.node.hop.route_step import RouteStepper
from services.node.hop.routing import TrackerRoutes
from services.node.hop.row_sender import RowSender
from services.node.hop.trust import RouteTrust, may_fetch
from services.node.metrics import NodeMetrics
from services.node.model.device import pick_device, pick_dtype
from services.node.model.memory_budget import default_budget_bytes, kv_bytes_per_token, measure_layer_costs
from services.node.model.model_source import resolve_model
from services.node.model.quant.packed import QUANTIZED_DTYPE
from services.node.model.quant.quant_kernel import choose_activations
from services.node.model.quant.quant_load import resolve_format
from services.node.model.rows_exact import rows_exact_path
from services.node.model.shard import Shard
from services.node.model.shard_load import load_shard
from services.node.pd.handoff_limits import HandoffLimits
from services.node.pd.kv_pull import KvPuller
from services.node.pd.kv_transfer import kv_shape
from services.node.pd.pd_head import PdHead
from services.node.pd.pd_member import PrefillMembership
from services.node.sampling.grammar import GrammarEngine
from services.node.settings import NodeSettings, NodeState

logger = logging.getLogger(__name__)

DTYPE_ROWS: Final = 1
"""Rows per decode step ``--dtype auto`` chooses the number format for (see services/node/model/device.py)."""

HTTP_POOL_CONNECTIONS: Final = 64
"""Keep-alive connections to other hops and the tracker."""
CONNECT_TIMEOUT_S: Final = 5.0
MOVE_DRAIN_S: Final = 30.0
"""How long a node told to move waits for its sessions to finish before it switches (the rest fail over)."""
MOVE_DRAIN_POLL_S: Final = 0.2
MIN_PROBE_SECONDS: Final = 1e-9
"""Floor of the measured seconds a layer sent to the tracker (a timer that read 0 is not infinitely fast)."""


class NodeRuntime:
    """Everything one node holds: its shard, sessions, clients and background tasks."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.node_id = settings.resolved_node_id()
        self.state: NodeState = "starting"
        self.model_id = settings.model
        self.sessions = SessionTable(kv_budget_tokens=settings.kv_budget_tokens, max_sessions=settings.max_sessions,
                                     idle_timeout_s=settings.idle_timeout_s, handoff_ttl_s=settings.handoff_ttl_s)
        self.metrics = NodeMetrics(self.sessions)
        self.sessions.on_handoff_expired = self.metrics.handoffs_freed.labels(how="expired").inc
        self.worker = ComputeWorker(settings.threads)
        one_torch_thread()  # the event loop's thread: only the compute thread runs torch with several threads
        self.http = httpx.AsyncClient(
            http1=True, http2=False,
            limits=httpx.Limits(max_connections=HTTP_POOL_CONNECTIONS, max_keepalive_connections=HTTP_POOL_CONNECTIONS),
            timeout=httpx.Timeout(settings.hop_timeout_s, connect=CONNECT_TIMEOUT_S),
            verify=tls.httpx_verify(settings.tls_ca),
        )
        self.hop_key = settings.hop_key()
        """This node's own Ed25519 key: it signs the frames this node sends; its public half is registered."""
        self.hops = HopClient(self.http, settings.mesh_credential(), settings.hop_timeout_s, node_id=self.node_id,
                              hop_key=self.hop_key, tls_context=tls.client_context(settings.tls_ca),
                              own_relays=(settings.relay,) if settings.relay else ())
        self.tracker_routes = TrackerRoutes(self.http, settings.tracker, settings.mesh_credential(), self.node_id)
        pinned = settings.pinned_keys()
        fetches = may_fetch(pinned, settings.tracker)
        if self.tracker_routes.available and not fetches:
            logger.warning("route keys: pinned by MESHNET_ROUTE_KEYS and a tracker is plain http:// across a network, "
                           "so this node trusts its pins alone and never adds what a tracker's GET /v1/keys answers")
        self.trust = RouteTrust(pinned, self.tracker_routes.fetch_keys if fetches else None)
        """The tracker's route keys this node verifies routes with (pinned, and fetched at registration)."""
        self.tracker_routes.trust = self.trust
        self.hops.route_keys = lambda: self.trust.keys  # blame downstream only on signed evidence (hop_client)
        self.receipt_reporter = ReceiptReporter(self.tracker_routes)
        """A head's steps' receipts, on their way to the tracker (issue 37; off with ``--no-receipts``)."""
        self.hop_auth = HopAuth(node_id=self.node_id, model_id=self.model_id, trust=self.trust,
                                legacy_secret=None if settings.join_token else settings.secret)
        """The front door every call from the mesh passes: frames, handoffs, the tracker's calls to a head."""
        self.shard: Shard | None = None
        self._load_args: tuple[Path, torch.dtype, torch.device, str, Path | None, int | None] | None = None
        """How this node's layers were loaded (model folder, dtype, device, weights, GGUF, budget): a move reloads."""
        self._handoff_limits: HandoffLimits | None = None
        self._moving: asyncio.Task[None] | None = None
        self.placement: PlacementReason = "pinned"
        self.activations: Activations = "float32"
        """The rows this node's quantized products take, as chosen at start (``--activations``)."""
        """Why this node holds its layers: ``pinned`` (``--layers``, or every layer), or the tracker's reason."""
        self._rows_exact: tuple[Shard, str | None] | None = None
        """The shard whose batch-invariant path was last worked out, and that path (:meth:`rows_exact`)."""
        self.runner: ShardRunner | None = None
        self.forward: ForwardService | None = None
        self.generator: Generator | None = None
        self.grammar: GrammarEngine | None = None
        """Structured outputs' grammar engine (built on first use): the head checks grammars, the tail enforces them."""
        self.registrar: Registrar | None = None
        self.relay_addr: str | None = None
        self.puller: KvPuller | None = None
        """Pulls handoffs' KV from prefill nodes (with ``--bootstrap``, on a node that decodes)."""
        self.membership: PrefillMembership | None = None
        """A prefill node's place in the bootstrap registry (``--role prefill --bootstrap URL``)."""
        self.kv_serve: KvServeService | None = None
        self.sampling_defaults = SamplingDefaults()
        """Where other nodes reach this one through the relay (with ``--relay``)."""
        self._relay_peer: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    # --- start ------------------------------------------------------------------------

    async def start(self, app: ASGIApp | None = None) -> None:
        """Load this node's layers, warm up, and join the mesh.

        ``app`` is the node's own ASGI app: with ``--relay`` the requests that
        arrive over the relay are served by it.
        """
        s = self.settings
        began = time.perf_counter()
        asyncio.get_running_loop().set_default_executor(  # asyncio.to_thread's threads: torch on one thread each
            ThreadPoolExecutor(thread_name_prefix="meshnet-io", initializer=one_torch_thread))
        resolved = await self.worker.run(resolve_model, s.model, s.model_cache_dir)
        self.model_id = resolved.model_id
        self.hop_auth.model_id = self.model_id
        device = pick_device(s.device)
        self.worker.use_gate(cpu_gate_for(s.cpu_lock, device.type), self.metrics.cpu_gate_wait.observe)
        # Chosen for one row: a lone stream's speed is what a user meets first, and the table's batch
        # bands trade it away (on an AMX Xeon bfloat16 wins from 4 rows but is 1.3x slower for one).
        weights, why = await asyncio.to_thread(resolve_format, s.weights, resolved.gguf)
        if weights != "float" and s.dtype == "auto" and device.type == "cpu":
            # Only the products' rows are rounded to the packed kernel's bfloat16; the residual stream, norms
            # and attention stay float32: a bfloat16 residual stream cost 3 of 20 greedy answers of the
            # default model (16/20 agreed with the float32 mesh at 8 tokens, 19/20 with a float32 stream).
            dtype = QUANTIZED_DTYPE
            logger.info("weights %s (%s); dtype auto: %s between the packed products", weights, why,
                        DTYPE_NAMES[dtype])
        else:
            dtype = pick_dtype(s.dtype, device, rows=DTYPE_ROWS)
            logger.info("weights %s (%s)", weights, why)
        if weights != "float" and device.type == "cpu":  # float weights never build or call the native kernel
            self.activations = cast(Activations, await asyncio.to_thread(choose_activations, s.activations))
        config = await asyncio.to_thread(AutoConfig.from_pretrained, resolved.path)
        gguf = resolved.gguf if weights != "float" else None
        budget = s.max_memory
        if s.layer_range() is not None or s.tracker is None:
            start, end = s.layer_range() or (0, config.num_hidden_layers - 1)
        else:  # no --layers: the tracker places this node within its memory
            budget = budget or default_budget_bytes(device)
            start, end = await self._ask_placement(resolved.path, dtype, device, weights, gguf, budget)
        self.shard = await self.worker.run(load_shard, resolved.path, start, end, dtype, device, weights, gguf,
                                           s.kv_dtype)
        weight_bytes = self.shard.weight_bytes()
        if budget is not None:
            self._cap_kv(budget, weight_bytes)
        self.metrics.weight_bytes.set(weight_bytes)
        self._load_args = (resolved.path, dtype, device, weights, gguf, budget)
        self.grammar = GrammarEngine(resolved.path, self.shard.vocab_size, eos_ids_of(resolved.path, self.shard.config))
        shape = kv_shape(self.shard)
        self._handoff_limits = HandoffLimits(max_held=s.handoff_max_held, max_bytes=s.handoff_max_bytes,
                                             position_bytes=shape.position_bytes_per_layer)
        if s.bootstrap is not None and s.role != "prefill":
            self.puller = KvPuller(node_id=self.node_id, hop_key=self.hop_key, trust=self.trust,
                                   model_id=self.model_id, bootstrap_url=s.bootstrap, shape=shape,
                                   max_chunk_bytes=s.max_frame_bytes,
                                   timeout_s=s.handoff_pull_timeout_s, metrics=self.metrics,
                                   verify=tls.httpx_verify(s.tls_ca), nice=s.kv_pull_nice)
        if s.role == "prefill":
            if s.bootstrap is None:
                logger.warning("--role prefill without --bootstrap: this node registers in no bootstrap registry, so "
                               "decode nodes cannot find it and it takes no prefill routes")
            else:
                self.membership = PrefillMembership(bootstrap_url=s.bootstrap, public_url=s.public_url(), shape=shape,
                                                    node_id=self.node_id, hop_key=self.hop_key)
        self._install(*await self._serving(self.shard, ShardRunner(
            self.shard, self.worker, max_batch=s.max_batch, max_step_tokens=s.max_step_tokens,
            on_batch=self.metrics.batch_rows.observe)))
        assert self.runner is not None
        await self.runner.warm_up()
        self._tasks.append(asyncio.create_task(
            run_sweeper(self.sessions, self.metrics.sessions_expired.inc), name="idle-sweeper"))
        if s.relay is not None and app is not None:
            self._start_relay_peer(app)
        if s.tracker is not None:
            self.registrar = Registrar(self.http, s.tracker, s.mesh_credential(), self.registration, s.heartbeat_s,
                                       on_new_lease=self.trust.refresh,
                                       on_answer=self._on_answer)
            self._tasks.append(asyncio.create_task(self.registrar.run(), name="registration"))
        self.state = "ready"
        logger.info("node %s ready in %.1f s: %s layers %d-%d of %d on %s as %s at %s", self.node_id,
                    time.perf_counter() - began, self.model_id, start, end, self.shard.num_layers, device,
                    DTYPE_NAMES[dtype], s.public_url())

    async def _serving(self, shard: Shard, runner: ShardRunner) -> tuple[Shard, ShardRunner, ForwardService,
                                                                           KvServeService | None, Generator | None]:
        """Everything that serves ``shard`` through ``runner``, built but not installed (see :meth:`_install`)."""
        s = self.settings
        assert self.grammar is not None
        path = self._load_args[0]
        stepper = RouteStepper(node_id=self.node_id, runner=runner, sessions=self.sessions,
                               sender=RowSender(self.hops, max_rows=s.max_batch), metrics=self.metrics,
                               wire_dtype=s.wire_dtype, faults=FaultInjector(s.fault, self.metrics),
                               receipt_sink=self.receipt_reporter.take if s.receipts else None, receipts=s.receipts,
                               hop_key=self.hop_key if shard.is_head else None)
        if s.fault is not None and s.fault.kind == "wrong-token" and not shard.is_tail:
            logger.warning("--fault %s: this node is not a tail, so it answers no tokens to change", s.fault)
        forward = ForwardService(node_id=self.node_id, model_id=self.model_id, auth=self.hop_auth,
                                 runner=runner, sessions=self.sessions, hops=self.hops, stepper=stepper,
                                 metrics=self.metrics, frame_limits=FrameLimits(max_bytes=s.max_frame_bytes),
                                 grammar=self.grammar, puller=self.puller, handoff_limits=self._handoff_limits,
                                 hop_key=self.hop_key if s.receipts else None)
        kv_serve = None
        if self.membership is not None:
            kv_serve = KvServeService(
                node_id=self.node_id, model_id=self.model_id, auth=self.hop_auth, hop_key=self.hop_key,
                runner=runner, sessions=self.sessions, chains=ChainOpener(runner, self.sessions, self.hops, stepper),
                metrics=self.metrics, membership=self.membership, shape=kv_shape(shard), limits=self._handoff_limits,
                max_chunk_bytes=s.max_frame_bytes, prefill_chunk_tokens=s.prefill_chunk_tokens,
                max_prompt_tokens=s.max_prompt_tokens)
        generator = None
        if shard.is_head:
            tokenizer = await asyncio.to_thread(HeadTokenizer.from_folder, path, shard.config)
            draft_model = None
            if s.draft_model is not None:  # a vocabulary that differs raises DraftModelError: the node does not start
                draft_model = await asyncio.to_thread(load_draft_model, s.draft_model, tokenizer.vocabulary,
                                                      self.worker)
            self.sampling_defaults = SamplingDefaults.from_folder(path)
            generator = Generator(runner=runner, sessions=self.sessions, hops=self.hops, stepper=stepper,
                                  tokenizer=tokenizer, metrics=self.metrics,
                                  prefill_chunk_tokens=s.prefill_chunk_tokens,
                                  routes=self.tracker_routes, model_id=self.model_id, grammar=self.grammar,
                                  pd=None if self.puller is None else PdHead(
                                      http=self.http, node_id=self.node_id, hop_key=self.hop_key,
                                      puller=self.puller,
                                      timeout_s=s.hop_timeout_s),
                                  speculate=s.speculate, speculate_max=s.speculate_max,
                                  draft_model=draft_model)
        elif s.draft_model is not None:
            logger.warning("--draft-model %s is ignored: this node is not a head (layers %d-%d)", s.draft_model,
                           shard.start, shard.end)
        return shard, runner, forward, kv_serve, generator

    def _install(self, shard: Shard, runner: ShardRunner, forward: ForwardService, kv_serve: KvServeService | None,
                 generator: Generator | None) -> None:
        """Serve from now on with these (no await: requests see either the old set or the new one); a request
        still running on the old generator fails over onto the new one."""
        if self.generator is not None and generator is not None and self.generator is not generator:
            self.generator.successor = generator
        self.shard, self.runner, self.forward, self.kv_serve, self.generator = shard, runner, forward, kv_serve, \
            generator

    def _on_answer(self, answer: RegistrationAnswer) -> None:
        """A tracker's registration answer: revoked nodes, a prefill group's place, or a move to another range."""
        revoked = frozenset(answer.revoked_nodes)
        if revoked != self.trust.revoked:
            if revoked - self.trust.revoked:
                logger.warning("the tracker revoked %s: routes naming them are refused from now on",
                               ", ".join(sorted(revoked - self.trust.revoked)))
            self.trust.revoked = revoked
        quarantined = frozenset(answer.quarantined_nodes)
        if quarantined != self.trust.quarantined:
            if quarantined - self.trust.quarantined:
                logger.warning("the tracker quarantined %s for computing wrong: a head moves its streams off them at "
                               "their next step", ", ".join(sorted(quarantined - self.trust.quarantined)))
            self.trust.quarantined = quarantined
            self.metrics.quarantined_known.set(len(quarantined))
        if self.membership is not None:
            self.membership.on_answer(answer)
        move = answer.move
        if move is None or self.shard is None or self._moving is not None or self.state != "ready":
            return
        if (move.shard_start, move.shard_end) == (self.shard.start, self.shard.end):
            self.placement = move.reason  # told to stay: it now holds them for another reason
            return
        if self.membership is not None or self.puller is not None:
            logger.warning("the tracker asks this node to hold layers %d-%d; a node in prefill/decode handoffs "
                           "stays where it is", move.shard_start, move.shard_end)
            return
        self._moving = asyncio.create_task(self._move(move), name="placement-move")
        self._tasks.append(self._moving)

    async def _move(self, move: PlacementAnswer) -> None:
        """Load the new range while serving the old one, let sessions finish, switch, and register it."""
        s = self.settings
        path, dtype, device, weights, gguf, budget = self._load_args
        old = self.runner
        assert old is not None and self.shard is not None
        logger.info("moving: the tracker asks this node (layers %d-%d) to hold layers %d-%d (%s); loading them "
                    "while serving", self.shard.start, self.shard.end, move.shard_start, move.shard_end, move.reason)
        try:
            shard = await asyncio.to_thread(load_shard, path, move.shard_start, move.shard_end, dtype, device,
                                            weights, gguf, s.kv_dtype)
            runner = ShardRunner(shard, self.worker, max_batch=s.max_batch, max_step_tokens=s.max_step_tokens,
                                 on_batch=self.metrics.batch_rows.observe)
            await runner.warm_up()
            built = await self._serving(shard, runner)
            drain_until = time.monotonic() + MOVE_DRAIN_S
            while len(self.sessions) and time.monotonic() < drain_until:
                await asyncio.sleep(MOVE_DRAIN_POLL_S)
            left = [session.session_id for session in self.sessions]
            self._install(*built)
            for session_id in left:  # their heads fail over and replay them along a new route
                self.sessions.close(session_id)
            self.placement = move.reason
            if budget is not None:
                self._cap_kv(budget, shard.weight_bytes())
            self.metrics.weight_bytes.set(shard.weight_bytes())
            logger.info("moved: now serving layers %d-%d (%d sessions closed for failover)", shard.start, shard.end,
                        len(left))
            await old.engine.stop()
            if self.registrar is not None:
                await self.registrar.beat()
        except Exception:  # a failed move leaves the node serving its old range
            logger.exception("moving to layers %d-%d failed; serving layers as before", move.shard_start,
                             move.shard_end)
        finally:
            self._moving = None

    async def _ask_placement(self, path: Path, dtype: torch.dtype, device: torch.device, weights: str,
                             gguf: Path | None, budget: int) -> tuple[int, int]:
        """Measure one layer here, and ask the tracker which layers to load within ``budget`` bytes."""
        s = self.settings
        assert s.tracker is not None
        probe = await self.worker.run(measure_layer_costs, path, dtype, device, weights, gguf, s.kv_dtype)
        ask = PlacementRequest(node_id=self.node_id, model=self.model_id, num_layers=probe.num_layers,
                               max_memory_bytes=budget, layer_bytes=probe.layer_bytes, head_bytes=probe.head_bytes,
                               tail_bytes=probe.tail_bytes, kv_bytes_per_token=probe.kv_bytes_per_token,
                               seconds_per_layer=max(probe.seconds_per_layer, MIN_PROBE_SECONDS))
        try:
            answer = await ask_placement(self.http, s.tracker, s.mesh_credential(), ask)
        except PlacementRefused as exc:
            logger.error("node %s does not start: %s", self.node_id, exc)
            raise
        self.placement = answer.reason
        logger.info("the tracker placed this node on layers %d-%d (%s) within --max-memory %d bytes",
                    answer.shard_start, answer.shard_end, answer.reason, budget)
        return answer.shard_start, answer.shard_end

    def _cap_kv(self, budget: int, weight_bytes: int) -> None:
        """Keep weights plus every session's KV within ``budget``: the KV budget gets what the weights leave."""
        assert self.shard is not None
        itemsize = torch.empty((), dtype=self.shard.kv_dtype or self.shard.dtype).element_size()
        per_token = kv_bytes_per_token(self.shard.config, itemsize) * (self.shard.end - self.shard.start + 1)
        tokens = (budget - weight_bytes) // per_token
        if tokens < 1:
            raise PlacementRefused(f"layers {self.shard.start}-{self.shard.end} take {weight_bytes} bytes of weights, "
                                   f"which leaves no KV cache within --max-memory {budget} bytes")
        if tokens < self.sessions.kv_budget_tokens:
            logger.info("KV budget %d tokens (was %d): what --max-memory %d bytes leaves after %d bytes of weights",
                        tokens, self.sessions.kv_budget_tokens, budget, weight_bytes)
            self.sessions.kv_budget_tokens = tokens

    def _start_relay_peer(self, app: ASGIApp) -> None:
        if RelayPeer is None:
            logger.error("--relay given but meshwire.relay_client is not installed; serving directly only")
            return
        assert self.settings.relay is not None
        peer = RelayPeer(self.settings.relay, self.node_id, self.settings.mesh_credential(), asgi_handler(app),
                         ssl_context=tls.client_context(self.settings.tls_ca))
        self._relay_peer = peer
        self.relay_addr = peer.relay_addr
        self._tasks.append(asyncio.create_task(peer.run(), name="relay-peer"))
        logger.info("reachable through the relay at %s", self.relay_addr)

    def rows_exact(self) -> str | None:
        """The batch-invariant path this node's hop output takes, or ``None``
        (:func:`~services.node.model.rows_exact.rows_exact_path`); worked out once per loaded shard."""
        assert self.shard is not None
        if self._rows_exact is None or self._rows_exact[0] is not self.shard:
            s = self.settings
            turn = max(s.max_step_tokens, s.prefill_chunk_tokens) + s.max_batch
            self._rows_exact = (self.shard, rows_exact_path(self.shard, self.activations, turn))
        return self._rows_exact[1]

    def registration(self) -> NodeRegistration:
        """This node's registration body, with its load figures as of now."""
        assert self.shard is not None and self.runner is not None
        return NodeRegistration(
            node_id=self.node_id, model=self.model_id, endpoint=self.settings.public_url(),
            shard_start=self.shard.start, shard_end=self.shard.end, num_layers=self.shard.num_layers,
            relay_addr=self.relay_addr, dtype=DTYPE_NAMES[self.shard.dtype], device=str(self.shard.device),
            kv_capacity_tokens=self.sessions.kv_budget_tokens, kv_free_tokens=self.sessions.free_tokens,
            active_sessions=len(self.sessions), decode_tokens_per_s=round(self.runner.decode_tokens_per_s, 3),
            weights=self.shard.weights_format, activations=self.activations, weight_bytes=self.shard.weight_bytes(),
            kv_bytes=self.sessions.cache_bytes(), hop_key=self.hop_key.public_text, role=self.settings.role,
            pd_rank=None if self.membership is None else self.membership.pd_rank, placement=self.placement,
            rows_exact=self.rows_exact(),
        )

    # --- stop -------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop taking sessions, leave the mesh, and release everything."""
        self.state = "draining"
        self.sessions.drain()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.receipt_reporter.aclose()
        if self.registrar is not None:
            await self.registrar.deregister()
        if self._relay_peer is not None:
            await self._relay_peer.close()
        if self.membership is not None:
            await self.membership.aclose()
        if self.puller is not None:
            await self.puller.aclose()
        if self.generator is not None:
            await self.generator.drain()
        await self.hops.aclose()
        await self.http.aclose()
        if self.runner is not None:
            await self.runner.engine.stop()
        await asyncio.to_thread(self.worker.shutdown)
        self.state = "stopped"
