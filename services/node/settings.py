"""Configuration of a node, from ``MESHNET_*`` environment variables.

Every field has an environment twin ``MESHNET_<FIELD>`` and a ``meshnet node``
flag of the same name (``--kv-budget-tokens`` sets ``kv_budget_tokens``).
Every limit a node enforces on its callers is a field here, bounded, so an
operator can tighten it and a reviewer can find it.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from meshwire import limits, tls
from meshwire.auth import DEFAULT_SECRET
from meshwire.fields import ApiKeyList
from meshwire.route_keys import KeyProblem, KeySet, SigningKey
from meshwire.serving import SlowClientSettings, TlsClientSettings

DEFAULT_MODEL: Final = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_PORT: Final = 8100
DEFAULT_KV_BUDGET_TOKENS: Final = 32768
"""KV tokens a node holds across all its sessions (SmolLM2-135M float32: ~46 KiB a token for all layers)."""
DEFAULT_MAX_SESSIONS: Final = 64
DEFAULT_IDLE_TIMEOUT_S: Final = 300.0
DEFAULT_HEARTBEAT_S: Final = 5.0
DEFAULT_MAX_PROMPT_TOKENS: Final = 8192
DEFAULT_PREFILL_CHUNK_TOKENS: Final = 512
DEFAULT_HOP_TIMEOUT_S: Final = 120.0
MAX_THREADS: Final = 1024
DEFAULT_MAX_BATCH: Final = 16
"""Decode rows (sessions) in one batched step by default."""
DEFAULT_MAX_STEP_TOKENS: Final = 512
"""Tokens one compute turn takes by default, decode rows and prompt chunks together."""
MAX_BATCH_LIMIT: Final = 256
"""Largest ``max_batch`` accepted (rows of one batched decode step)."""
DEFAULT_HANDOFF_TTL_S: Final = 30.0
"""How long a prefill node holds a handoff's KV for decode nodes to pull by default."""
DEFAULT_HANDOFF_MAX_HELD: Final = 32
DEFAULT_HANDOFF_MAX_BYTES: Final = 1 << 30
DEFAULT_HANDOFF_PULL_TIMEOUT_S: Final = 30.0
MAX_NICE: Final = 19
"""The lowest priority a Unix thread can take."""
DEFAULT_NICE: Final = 10
"""How far below the node's priority its background work runs by default (``--kv-pull-nice``): about a tenth
of a core its decode steps also want."""
DEFAULT_CPU_LOCK: Final = "/tmp/meshnet-cpu.lock"
"""The lock file co-located nodes share unless told otherwise: one fixed path per machine, whoever runs them."""
NodeDType = Literal["auto", "float32", "bfloat16", "float16"]
NodeRole = Literal["prefill", "decode", "both"]
NodeState = Literal["starting", "ready", "draining", "stopped"]
"""Where a node is in its life: loading, serving, finishing its sessions, gone."""
WeightsMode = Literal["auto", "float", "int8", "int4"]
KvDType = Literal["auto", "float16", "bfloat16"]
ActivationsMode = Literal["auto", "float32", "int8"]
"""``--activations``: the rows quantized products take (see :func:`services.node.model.quant.quant_kernel.choose_activations`)."""
"""``--kv-dtype``: what a quantized shard's KV cache keeps (see :func:`services.node.model.shard_load.load_shard`)."""
WireDType = Literal["native", "int8"]
"""``--wire-dtype``: how hidden states travel to the next hop (see :mod:`meshwire.q8`)."""
"""``--weights``: see :mod:`services.node.model.quant.quant_load`."""

MAX_MEMORY_LIMIT: Final = 1 << 50
"""Largest ``--max-memory`` accepted (a petabyte)."""
_SIZE = re.compile(r"^\s*(\d{1,16}(?:\.\d{1,6})?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS: Final = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                      "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(value: object) -> object:
    """``"6GiB"``, ``"80MB"``, ``"512"`` (bytes) -> an int of bytes; ``None`` or empty -> ``None``."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(f"a size is a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value[:40]!r}")
        return int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").upper()])
    return value


_LAYERS = re.compile(r"^\s*(\d{1,5})\s*-\s*(\d{1,5})\s*$")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d{1,3})?|mps)$")


ALLOW_FAULTS_ENV: Final = "MESHNET_ALLOW_FAULTS"
"""The variable that must be ``1`` for a node to take ``--fault`` (fault injection is for tests and demonstrations)."""
FaultKind = Literal["corrupt-output", "wrong-token"]
"""``corrupt-output``: perturb the hidden states sent on; ``wrong-token``: a tail answers another token than it sampled."""
MAX_FAULT_SPEC_CHARS: Final = 64
_FAULT_SPEC = re.compile(r"^\s*([a-z-]{1,32})\s*:\s*([0-9.eE+-]{1,24})\s*$")


class FaultSpec(BaseModel):
    """``--fault KIND:P``: which fault a node injects, and in what fraction ``P`` (0 < P <= 1) of its steps."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    kind: FaultKind
    rate: float = Field(gt=0.0, le=1.0)

    def __str__(self) -> str:
        return f"{self.kind}:{self.rate:g}"


def _fault_spec(value: object) -> object:
    """``"corrupt-output:0.5"`` -> :class:`FaultSpec` (``None`` when empty); a clear error naming the form."""
    if value is None or isinstance(value, FaultSpec):
        return value
    if not isinstance(value, str):
        raise ValueError("fault must be a string KIND:P")  # noqa: TRY004 - pydantic reports ValueError only
    if not value.strip():
        return None
    match = _FAULT_SPEC.match(value) if len(value) <= MAX_FAULT_SPEC_CHARS else None
    if match is None:
        raise ValueError(f"fault must be 'corrupt-output:P' or 'wrong-token:P' (0 < P <= 1), got {value[:80]!r}")
    kind, rate_text = match.groups()
    if kind not in ("corrupt-output", "wrong-token"):
        raise ValueError(f"fault kind must be corrupt-output or wrong-token, got {kind!r}")
    try:
        rate = float(rate_text)
    except ValueError:
        raise ValueError(f"fault rate {rate_text!r} is not a number") from None
    if not 0.0 < rate <= 1.0:  # also refuses nan
        raise ValueError(f"fault rate must be in (0, 1], got {rate_text}")
    return FaultSpec(kind=kind, rate=rate)


MAX_TRACKERS: Final = 16
"""Most tracker URLs one node may be given."""


class TrackerUrls(tuple[str, ...]):
    """The trackers a node knows, in the order it tries them (a tuple of base URLs without a trailing ``/``).

    Formatted as a string it is its first URL, so code that talks to one
    tracker (``f"{settings.tracker}/v1/route"``) keeps working; the registrar
    (:mod:`services.node.hop.registration`) uses every one.
    """

    __slots__ = ()

    def __str__(self) -> str:
        return self[0]

    def __format__(self, spec: str) -> str:
        return format(self[0], spec)


def _tracker_urls(value: object) -> object:
    """``"URL1, URL2/"`` or a sequence -> :class:`TrackerUrls` (``None`` when empty); bounded."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list | tuple):
        return value  # the field's own type check names the problem
    urls = [str(url).strip().rstrip("/") for url in value if str(url).strip()]
    if len(urls) > MAX_TRACKERS:
        raise ValueError(f"at most {MAX_TRACKERS} trackers")
    for url in urls:
        if len(url) > limits.MAX_URL_CHARS or not url.startswith(("http://", "https://")):
            raise ValueError(f"tracker {url[:100]!r} must be an http(s):// URL of at most {limits.MAX_URL_CHARS} "
                             "characters")
    if len(set(urls)) != len(urls):
        raise ValueError("a tracker URL is listed twice")
    return TrackerUrls(urls) if urls else None


class NodeSettings(BaseSettings, SlowClientSettings, TlsClientSettings):
    """Everything a node needs to know to load its layers and join a mesh (TLS and the slow-client guards from
    :mod:`meshwire.serving`)."""

    model_config = SettingsConfigDict(env_prefix="MESHNET_", frozen=True, extra="ignore",
                                      use_attribute_docstrings=True)

    model: str = Field(default=DEFAULT_MODEL, min_length=1, max_length=limits.MAX_URL_CHARS)
    """A local folder of a Hugging Face causal LM, a GGUF file (or the first of a split set), or a hub name."""
    layers: str | None = None
    """Layers this node holds, ``"A-B"`` inclusive; ``None``: the tracker places the node (with ``tracker``),
    else every layer."""
    max_memory: Annotated[Annotated[int, Field(ge=1, le=MAX_MEMORY_LIMIT)] | None, BeforeValidator(parse_size)] = None
    """Memory this node may use for weights and KV cache together (``6GiB``, ``80MB``). Without ``layers`` the
    tracker places the node within it; its KV budget is capped to what is left after the weights. Default: most
    of the memory found free (the GPU's on CUDA)."""
    tracker: Annotated[TrackerUrls | None, NoDecode, BeforeValidator(_tracker_urls)] = None
    """Tracker base URLs, comma-separated (``URL1,URL2``): heartbeats go to the first that answers; none: no tracker."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    """TCP port to listen on."""
    relay: str | None = Field(default=None, max_length=limits.MAX_URL_CHARS)
    """Relay base URL (``ws://relay:8001``) when this node is reached through a relay."""
    dtype: NodeDType = "auto"
    """Number format of the layers; ``auto`` picks the fastest for the device and logs why."""
    device: str = "auto"
    """``auto`` (the first CUDA GPU, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    weights: WeightsMode = "auto"
    """Format the layers' weights are held in: ``float`` (the ``dtype``), or ``int8``/``int4`` packed with
    group-wise scales (a GGUF's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 matrices as the file holds them: see "Weights held quantized");
    ``auto`` serves a quantized file (the default model's Q4_1 GGUF, a Q4_K_M file) packed, a float checkpoint, or a file
    holding another type (Q3_K, IQ*), as float."""
    kv_dtype: KvDType = "auto"
    """Format of the KV cache of quantized layers: ``auto`` keeps the compute format (float32, exact), ``float16``
    or ``bfloat16`` half the bytes, so long contexts take half the memory and their decode steps read half
    (a 2,048-token row, 30 layers: 6.4 -> 2.9 ms of attention). Float weights keep their own format."""
    activations: ActivationsMode = "auto"
    """Rows of quantized layers' products: ``int8`` quantizes them per group of 32 inputs (one scale each, as
    llama.cpp's Q8 activations) for integer dot products (AVX512-VNNI, AMX-INT8), about twice as fast and
    within 0.5% of float32 in mean log-likelihood; ``float32`` multiplies the float rows (exact to the
    dequantized weights; the exactness tests pin it); ``auto`` takes int8 where the CPU has VNNI or AMX-INT8.
    Float weights always take float rows."""
    secret: str = Field(default=DEFAULT_SECRET, min_length=1, max_length=1024)
    """The mesh's shared secret: admits this node where it holds no join token (a mesh that issues none)."""
    join_token: str | None = Field(default=None, min_length=1, max_length=256)
    """This node's own credential (``meshnet token create``), used in place of the secret with the tracker and relay."""
    route_keys: str | None = Field(default=None, max_length=16 * 1024)
    """Route-signing public keys pinned by hand (a JWK set, JSON), trusted besides the tracker's ``GET /v1/keys``."""
    node_key: str | None = Field(default=None, min_length=43, max_length=43)
    """This node's hop key (an Ed25519 seed, base64url) that signs the frames it sends; default: a fresh one."""
    api_keys: Annotated[tuple[str, ...], NoDecode, ApiKeyList] = ()
    """Client API keys this head's ``/v1`` endpoints accept besides the mesh secret (comma-separated), opening
    the head to clients directly, with no per-key limit; never the tracker's keys. Empty (advised): only the
    tracker's signed calls (and the mesh secret on a node without a join token) reach them."""
    node_id: str | None = Field(default=None, min_length=1, max_length=limits.MAX_ID_CHARS,
                                pattern=r"^[A-Za-z0-9._:\-]+$")
    """This node's id in the mesh; default: generated from the host, port and a random suffix."""
    advertise: str | None = Field(default=None, max_length=limits.MAX_URL_CHARS)
    """Base URL other nodes and the tracker reach this node at; default ``http://host:port``."""
    model_cache_dir: Path | None = None
    """Where converted models are kept; ``None``: ``$XDG_CACHE_HOME/meshnet/models`` or ``~/.cache/meshnet/models``."""

    kv_budget_tokens: int = Field(default=DEFAULT_KV_BUDGET_TOKENS, ge=1, le=1 << 32)
    """KV tokens reserved by all open sessions together may not exceed this."""
    max_sessions: int = Field(default=DEFAULT_MAX_SESSIONS, ge=1, le=1 << 16)
    """Open sessions at most; a new one beyond is refused with 503."""
    idle_timeout_s: float = Field(default=DEFAULT_IDLE_TIMEOUT_S, gt=0, le=86400)
    """A session untouched this long is closed and its KV cache freed."""
    heartbeat_s: float = Field(default=DEFAULT_HEARTBEAT_S, gt=0, le=3600)
    """Seconds between heartbeats to the tracker; a tracker asking for a shorter interval gets it."""
    max_frame_bytes: int = Field(default=limits.FRAME_MAX_BYTES, ge=1024, le=limits.FRAME_MAX_BYTES)
    """Largest activation frame accepted on ``/forward``."""
    max_prompt_tokens: int = Field(default=DEFAULT_MAX_PROMPT_TOKENS, ge=1, le=1 << 20)
    """Longest prompt a head accepts, in tokens (never more than the model's context)."""
    max_body_bytes: int = Field(default=limits.MAX_REQUEST_BYTES, ge=1024, le=limits.MAX_REQUEST_BYTES)
    """Largest JSON request body (chat/completions) read."""
    prefill_chunk_tokens: int = Field(default=DEFAULT_PREFILL_CHUNK_TOKENS, ge=1, le=1 << 16)
    """A prompt is sent along the route in frames of at most this many tokens."""
    max_batch: int = Field(default=DEFAULT_MAX_BATCH, ge=1, le=MAX_BATCH_LIMIT)
    """Decode steps of different sessions run as one batch, at most this many rows."""
    max_step_tokens: int = Field(default=DEFAULT_MAX_STEP_TOKENS, ge=1, le=1 << 16)
    """Tokens one compute turn takes, decode rows and prompt chunks together (the oldest chunk always runs)."""
    hop_timeout_s: float = Field(default=DEFAULT_HOP_TIMEOUT_S, gt=0, le=3600)
    """How long a hop waits for the rest of the route to answer one frame."""
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    """torch intra-op threads; ``None`` keeps torch's default."""
    speculate: Literal["auto", "on", "off"] = "auto"
    """Speculative decode steps on a head: drafted tokens (prompt lookup) travel the route with the last one
    and the tail verifies them; ``auto`` drafts where the route's round trip makes it pay (never on loopback),
    ``on`` whenever the drafter has a proposal, ``off`` never. Output is unchanged (greedy: token for token)."""
    speculate_max: int = Field(default=4, ge=1, le=16)
    """Most tokens drafted for one speculative step."""
    draft_model: Path | None = None
    """A local folder of a small causal LM sharing the served model's tokenizer: a head drafts with it (greedy,
    its own KV cache per request) instead of prompt lookup. A vocabulary that differs stops the node at start."""
    wire_dtype: WireDType = "native"
    """Hidden states sent to the next hop: ``native`` (exact, the layers' format) or ``int8`` (8-bit blockwise
    quantised, a scale per 32 values: about a quarter of float32's bytes, lossy; for slow links)."""
    fault: Annotated[FaultSpec | None, NoDecode, BeforeValidator(_fault_spec)] = None
    """For tests and demonstrations only, refused unless ``MESHNET_ALLOW_FAULTS=1``: ``corrupt-output:P`` perturbs
    a fraction P of the hidden states this node sends on, ``wrong-token:P`` makes a tail answer another token
    than it sampled in a fraction P of its steps (which steps: drawn per position, the same on every run)."""
    receipts: bool = True
    """Sign a receipt of every step this node runs (issue 37), pass the receipts of the hops after it back, and
    (at a head) report them to the tracker, which spot-checks nodes with them. Off: no output hashing, no
    signatures, no reports; the tracker then has nothing to compare for this node's steps."""
    cpu_lock: str = Field(default=DEFAULT_CPU_LOCK, max_length=limits.MAX_URL_CHARS)
    """File CPU nodes on one machine lock so their forwards take turns on its cores; ``off`` disables."""

    role: NodeRole = "both"
    """``prefill``: prefill long prompts and hold their KV for decode nodes to pull (registers in the bootstrap
    registry); ``decode``: decode (pulling prompts' KV from prefill nodes); ``both``: whole requests, and pulls."""
    bootstrap: str | None = Field(default=None, max_length=limits.MAX_URL_CHARS)
    """The PD bootstrap registry's base URL (``meshnet bootstrap --registry cache-layouts``); needed for roles
    ``prefill`` and ``decode``/``both`` to take part in prefill/decode handoffs."""
    handoff_ttl_s: float = Field(default=DEFAULT_HANDOFF_TTL_S, gt=0, le=3600)
    """A prefill node frees a handoff's KV this long after its prompt ran if no decode node pulled all of it."""
    handoff_max_held: int = Field(default=DEFAULT_HANDOFF_MAX_HELD, ge=1, le=1 << 16)
    """Handoffs a prefill node holds at once at most; a prefill beyond is refused (the decode route prefills)."""
    handoff_max_bytes: int = Field(default=DEFAULT_HANDOFF_MAX_BYTES, ge=1 << 16, le=1 << 40)
    """Bytes of KV a prefill node holds for handoffs at once at most."""
    handoff_pull_timeout_s: float = Field(default=DEFAULT_HANDOFF_PULL_TIMEOUT_S, gt=0, le=3600)
    """How long a decode node may take to pull a handoff's KV before it prefills the prompt itself."""
    kv_pull_nice: int = Field(default=DEFAULT_NICE, ge=0, le=MAX_NICE)
    """How far below the node's CPU priority a decode node pulls a handoff's KV (0: the same): the streams it
    already decodes keep their pace while a long prompt's KV arrives, which then takes longer on a busy node."""

    @field_validator("join_token", "route_keys", "node_key", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("fault")
    @classmethod
    def _faults_allowed(cls, value: FaultSpec | None) -> FaultSpec | None:
        if value is not None and os.environ.get(ALLOW_FAULTS_ENV) != "1":
            raise ValueError(f"fault injection is for tests and demonstrations: refused unless {ALLOW_FAULTS_ENV}=1 "
                             "is set")
        return value

    @field_validator("route_keys")
    @classmethod
    def _check_route_keys(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                KeySet.parse(value)
            except KeyProblem as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("node_key")
    @classmethod
    def _check_node_key(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                SigningKey.from_seed(value)
            except (KeyProblem, ValueError) as exc:
                raise ValueError(f"node_key: {exc}") from None
        return value

    def pinned_keys(self) -> KeySet:
        """The route keys pinned by hand (``route_keys``); empty when none."""
        return KeySet.parse(self.route_keys) if self.route_keys else KeySet()

    def hop_key(self) -> SigningKey:
        """This node's hop key: ``node_key``, or a fresh one (callers keep the result)."""
        return SigningKey.from_seed(self.node_key) if self.node_key else SigningKey.generate()

    def mesh_credential(self) -> str:
        """What this node shows the tracker and the relay: its join token, else the shared secret."""
        return self.join_token or self.secret

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        match = _LAYERS.match(value)
        if match is None:
            raise ValueError(f"layers must be 'A-B' (inclusive), got {value!r}")
        start, end = int(match.group(1)), int(match.group(2))
        if start > end:
            raise ValueError(f"layers {value!r}: the first layer is after the last")
        return f"{start}-{end}"

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {value!r}")
        return value

    @field_validator("advertise", "relay", "bootstrap")
    @classmethod
    def _strip_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        return value.strip().rstrip("/")

    def layer_range(self) -> tuple[int, int] | None:
        """``(start, end)`` inclusive, or ``None`` for every layer."""
        if self.layers is None:
            return None
        start, _, end = self.layers.partition("-")
        return int(start), int(end)

    def public_url(self) -> str:
        """The base URL this node registers: ``advertise``, else ``http(s)://host:port``."""
        if self.advertise:
            return self.advertise
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{tls.scheme(self.tls_cert is not None)}://{host}:{self.port}"

    def resolved_node_id(self) -> str:
        """``node_id``, or a fresh random one (callers keep the result)."""
        return self.node_id or f"node-{uuid.uuid4().hex[:12]}"
