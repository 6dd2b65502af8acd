"""OpenAI-compatible request, response and stream-chunk schemas, behind one name.

Callers write ``from meshwire import openai as oa`` and ``oa.ChatCompletionRequest``;
every name below is re-exported here. The modules, one concept each:

- :mod:`.messages`   a chat request's messages, their text parts, the tool calls in the history
- :mod:`.formats`    ``response_format``: free text, a JSON object, JSON matching a schema
- :mod:`.tools`      ``tools`` and ``tool_choice``
- :mod:`.requests`   the two request bodies and the sampling parameters they share
- :mod:`.responses`  non-streamed answers, log-probabilities, usage, models, errors
- :mod:`.chunks`     streamed answers (``chat.completion.chunk``, ``text_completion``)
- :mod:`.ids`        an answer's ``id`` and ``created``
- :mod:`.validation` a validation error as the one sentence of a 400

Requests follow what the OpenAI API accepts, and nothing is silently
ignored: every top-level parameter of a request is honoured, refused with a
400 that names it and says why (:func:`refused`: the deprecated functions API,
penalties, ...), or one of the few OpenAI itself documents as having no effect
on the answer (:data:`NO_EFFECT`: ``user``, ``store``, ``metadata``); an
unknown parameter is a 400 too, as OpenAI answers it. An integer is accepted
where a number is expected (``"temperature": 1`` is an integer in JSON), and
everything else is strictly typed and bounded. A bad request becomes one
sentence naming the field via :func:`validation_error_message`, which
services put in a 400 error body.

Responses are built by the services and serialised with ``model_dump_json``;
stream chunks go out as server-sent events (:mod:`meshwire.sse`).
"""

from __future__ import annotations

from meshwire.openai.chunks import (
    ChatCompletionChunk,
    ChunkChoice,
    CompletionChunk,
    Delta,
    FunctionDelta,
    SparseModel,
    ToolCallDelta,
)
from meshwire.openai.formats import (
    MAX_SCHEMA_CHARS,
    SCHEMA_NAME_PATTERN,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    ResponseFormat,
    TextFormat,
    compact_chars,
)
from meshwire.openai.ids import new_id, now_s
from meshwire.openai.messages import (
    MAX_ARGUMENTS_CHARS,
    MAX_HISTORY_TOOL_CALLS,
    MAX_NAME_CHARS,
    MAX_TOOL_CALL_ID_CHARS,
    PART_SEPARATOR,
    REQUEST_MODEL,
    ChatMessage,
    FunctionCallIn,
    Role,
    TextPart,
    ToolCallIn,
)
from meshwire.openai.requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_CHOICES,
    MAX_COMPLETION_LOGPROBS,
    MAX_METADATA_ENTRIES,
    MAX_USER_CHARS,
    NO_EFFECT,
    SEED_MAX,
    SEED_MIN,
    TOP_LEVEL_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    NoFunctions,
    NoPrediction,
    NoReasoning,
    NoSuffix,
    NoWebSearch,
    OneTier,
    Penalty,
    SamplingRequest,
    StopSequence,
    StreamOptions,
    TextModalityOnly,
    TextOnly,
    TokenCount,
    choice_seed,
    refused,
)
from meshwire.openai.responses import (
    AnswerEnvelope,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    ErrorDetail,
    ErrorResponse,
    FinishReason,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from meshwire.openai.tools import MAX_TOOLS, FunctionName, FunctionSpec, NamedToolChoice, ToolChoice, ToolSpec
from meshwire.openai.validation import validation_error_message, validation_error_param

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "MAX_ARGUMENTS_CHARS",
    "MAX_CHOICES",
    "MAX_COMPLETION_LOGPROBS",
    "MAX_HISTORY_TOOL_CALLS",
    "MAX_METADATA_ENTRIES",
    "MAX_NAME_CHARS",
    "MAX_SCHEMA_CHARS",
    "MAX_TOOLS",
    "MAX_TOOL_CALL_ID_CHARS",
    "MAX_USER_CHARS",
    "NO_EFFECT",
    "PART_SEPARATOR",
    "REQUEST_MODEL",
    "SCHEMA_NAME_PATTERN",
    "SEED_MAX",
    "SEED_MIN",
    "TOP_LEVEL_REQUEST",
    "AnswerEnvelope",
    "AssistantMessage",
    "ChatChoice",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatLogprobs",
    "ChatMessage",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "Delta",
    "ErrorDetail",
    "ErrorResponse",
    "FinishReason",
    "FunctionCall",
    "FunctionCallIn",
    "FunctionDelta",
    "FunctionName",
    "FunctionSpec",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "NoFunctions",
    "NoPrediction",
    "NoReasoning",
    "NoSuffix",
    "NoWebSearch",
    "OneTier",
    "Penalty",
    "ResponseFormat",
    "Role",
    "SamplingRequest",
    "SparseModel",
    "StopSequence",
    "StreamOptions",
    "TextFormat",
    "TextModalityOnly",
    "TextOnly",
    "TextPart",
    "TokenCount",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallIn",
    "ToolChoice",
    "ToolSpec",
    "TopLogprob",
    "Usage",
    "choice_seed",
    "compact_chars",
    "new_id",
    "now_s",
    "refused",
    "validation_error_message",
    "validation_error_param",
]
