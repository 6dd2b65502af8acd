"""The bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions``, and the parameters they share.

Nothing is silently ignored: every top-level parameter is honoured, refused
with a 400 that names it and says why (:func:`refused`: the deprecated
functions API, penalties, audio, ...), or one of the few OpenAI itself
documents as having no effect on the answer (:data:`NO_EFFECT`); an unknown
parameter is a 400 too, as OpenAI answers it.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from meshwire import limits
from meshwire.fields import AsTuple
from meshwire.openai.formats import ResponseFormat, TextFormat
from meshwire.openai.messages import REQUEST_MODEL, ChatMessage
from meshwire.openai.tools import MAX_TOOLS, NamedToolChoice, ToolChoice, ToolSpec
from meshwire.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_TOP_LOGPROBS

TOP_LEVEL_REQUEST: Final = ConfigDict(frozen=True, strict=True, extra="forbid")
"""A request body: an unknown parameter is refused (OpenAI: "Unrecognized request argument supplied")."""

MAX_USER_CHARS: Final = 256
SEED_MIN: Final = -(1 << 63)
SEED_MAX: Final = (1 << 64) - 1
DEFAULT_COMPLETION_MAX_TOKENS: Final = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""
MAX_COMPLETION_LOGPROBS: Final = 5
"""OpenAI's bound on ``logprobs`` of ``/v1/completions``."""

MAX_CHOICES: Final = 16
"""Largest ``n``: each choice is a session of its own on the mesh (KV cache on every hop)."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed``: ``seed + index`` (``None``: random, per choice).

    Choice 0 is the request with ``n=1``; choice ``i`` equals ``n=1`` with ``seed + i``. A sum past
    :data:`SEED_MAX` wraps round 2**64, as torch wraps a seed it is given.
    """
    if seed is None:
        return None
    out = seed + index
    return out - (1 << 64) if out > SEED_MAX else out


StopSequence = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
TokenCount = Annotated[int, Field(ge=1, le=limits.MAX_TOKENS_LIMIT)]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk carrying usage."""

    model_config = REQUEST_MODEL

    include_usage: bool = False


NO_EFFECT: Final = ("user", "store", "metadata")
"""Accepted and without effect on the answer, by design (as at OpenAI: end-user ids, storage, tags)."""
MAX_METADATA_ENTRIES: Final = 16
"""OpenAI's bound on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512."""


def refused(reason: str, *, allowed: tuple[Any, ...] = ()) -> Any:
    """The type of a parameter this server does not implement: absent, ``null`` or one of ``allowed`` (the
    values that ask for what it does anyway, e.g. ``{"type": "text"}``) passes; anything else is a 400
    naming the parameter and saying ``reason``."""
    def check(value: Any) -> Any:
        if value is not None and value not in allowed:
            raise ValueError(f"not supported: {reason}")
        return value
    return Annotated[Any, BeforeValidator(check)]


NoFunctions = refused("the deprecated functions API is not served; send tools and tool_choice instead")
OneTier = refused("a mesh has one tier")
TextModalityOnly = refused("this mesh answers text only", allowed=(["text"],))
TextOnly = refused("this mesh answers text only")
NoPrediction = refused("predicted outputs are not implemented")
NoReasoning = refused("the served model has no reasoning settings")
NoWebSearch = refused("this mesh has no web search")
NoSuffix = refused("insertion (a suffix after the completion) is not implemented")


class SamplingRequest(BaseModel):
    """The generation and sampling fields ``/v1/chat/completions`` and ``/v1/completions`` share.

    ``top_k`` is an extension (0 or absent: off). ``logit_bias`` is applied by
    the tail to the model's logits before anything else. Penalties are
    accepted only at 0 (their default): the tail does not see the tokens a
    replayed session generated, so it could not apply them faithfully.
    """

    model_config = TOP_LEVEL_REQUEST

    model: str = Field(min_length=1, max_length=limits.MAX_URL_CHARS)
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=limits.MAX_TOP_K)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    """Choices to generate, each its own session; choice ``i`` is sampled with :func:`choice_seed` (``seed``, ``i``)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    """Only read when ``stream`` is true."""
    stop: str | Annotated[tuple[StopSequence, ...], AsTuple,
                          Field(max_length=limits.MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    store: bool | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA_ENTRIES)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS,
                                                           allow_inf_nan=False)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    """Token id (as a string, as OpenAI takes it) to a bias in -100..100 added to its logit."""

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("penalties are not supported (only 0, the default): the tail of a route does not "
                             "see which tokens a session generated once a failover replays it")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit() or len(key) > 10:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key[:20]!r}")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs, in token order."""
        return tuple(sorted((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items()))

    @property
    def top_logprobs_wanted(self) -> int | None:
        """``None``: no log-probabilities; else how many alternatives per token (subclasses read their fields)."""
        return None

    response_format: ResponseFormat | None = None
    """Structured outputs: the tail constrains every token to a grammar compiled from it."""
    tools: Annotated[tuple[ToolSpec, ...], AsTuple, Field(max_length=MAX_TOOLS)] | None = None
    """Functions the model may call. Served only where the model's chat template renders tools (the head
    answers a 400 saying so otherwise); with ``tool_choice: "none"`` they are not offered and the answer is text."""
    tool_choice: ToolChoice | None = None
    """``auto`` (the default with tools): text or tool calls; ``required``: at least one call; a named
    function: exactly one call of it; ``none``: text, as if no tools were given."""
    parallel_tool_calls: bool | None = None
    """``false``: at most one tool call per answer (default: several may follow each other)."""

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> SamplingRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            twice = next(name for name in names if names.count(name) > 1)
            raise ValueError(f"tools declare the function {twice!r} more than once")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             "among the tools")
        if self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
        if self.wants_tools and self.response_format is not None and not isinstance(self.response_format,
                                                                                    TextFormat):
            raise ValueError("response_format cannot be combined with tools on this mesh (tool call arguments "
                             "follow their function's parameters schema); send one or the other, or "
                             "tool_choice 'none'")
        return self

    @property
    def wants_tools(self) -> bool:
        """True when the answer may (or must) be a tool call: tools given, and ``tool_choice`` is not ``none``."""
        return bool(self.tools) and self.tool_choice != "none"
    functions: NoFunctions = None
    function_call: NoFunctions = None
    service_tier: OneTier = None

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float | None) -> float | None:
        if value is not None and 0.0 < value < limits.MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {limits.MIN_TEMPERATURE}, got {value!r}")
        return value

    @property
    def choices(self) -> int:
        """How many choices the request asks for (``n``, 1 when absent)."""
        return self.n or 1

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            if len(value) > limits.MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {limits.MAX_STOP_SEQUENCES} stop sequences are allowed")
            if not all(isinstance(item, str) for item in value):
                raise ValueError("stop must be a string or a list of strings")
            return tuple(value)
        if value is not None and not isinstance(value, str):
            raise ValueError("stop must be a string or a list of strings")
        if isinstance(value, str) and len(value) > limits.MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may be at most {limits.MAX_STOP_CHARS} characters")
        return value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when absent; an empty string is no stop)."""
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,) if self.stop else ()
        return self.stop

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def token_budget(self, default: int) -> int:
        """How many tokens to generate at most: the request's limit, else ``default``."""
        return self.max_tokens if self.max_tokens is not None else default


class ChatCompletionRequest(SamplingRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: Annotated[tuple[ChatMessage, ...], AsTuple,
                        Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    max_completion_tokens: TokenCount | None = None
    """OpenAI's newer name for ``max_tokens``; wins when both are given."""
    logprobs: bool | None = None
    """Return each output token's log-probability."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: also the most likely alternatives at each position (0-20)."""
    modalities: TextModalityOnly = None
    audio: TextOnly = None
    prediction: NoPrediction = None
    reasoning_effort: NoReasoning = None
    web_search_options: NoWebSearch = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _bounded_prompt(self) -> ChatCompletionRequest:
        total = sum(len(message.text()) for message in self.messages)
        if total > limits.MAX_PROMPT_CHARS:
            raise ValueError(f"messages hold {total} characters, more than {limits.MAX_PROMPT_CHARS}")
        return self

    def token_budget(self, default: int) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().token_budget(default)


class CompletionRequest(SamplingRequest):
    """Body of ``POST /v1/completions``: one prompt string (or a list holding one)."""

    prompt: str = Field(max_length=limits.MAX_PROMPT_CHARS)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    """Return each output token's log-probability and this many likeliest alternatives (0-5)."""
    echo: bool = False
    """Give the prompt back before the completion; with ``logprobs``, with each prompt token's log-probability
    (the first has none: ``null``), computed by the tail from the prompt's own logits."""
    best_of: int | None = None
    suffix: NoSuffix = None

    @model_validator(mode="after")
    def _no_tools(self) -> CompletionRequest:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is a parameter of /v1/chat/completions; a raw completion has no tools")
        return self

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError(f"only best_of=1 is supported, got {value}")
        return value

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_string(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            if len(value) != 1 or not isinstance(value[0], str):
                raise ValueError("prompt must be a string or a list of exactly one string")
            return value[0]
        return value

    def token_budget(self, default: int = DEFAULT_COMPLETION_MAX_TOKENS) -> int:
        return super().token_budget(default)
