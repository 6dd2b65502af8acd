"""The grammar an answer must follow: a structured output's (``response_format``) or a tool call's (``tools``).

Each grammar is checked by the node's engine (:mod:`services.node.sampling.grammar`) before the request
runs, so a schema the engine cannot enforce is a 400 naming it, not a failure mid-answer.
"""

from __future__ import annotations

import asyncio

from meshwire import openai as oa
from meshwire.sampling_params import MAX_GRAMMAR_CHARS
from services.node.api.api_error import ApiError
from services.node.head.tokens import HeadTokenizer
from services.node.sampling.grammar import GrammarEngine, GrammarError, grammar_for_schema
from services.node.sampling.tool_grammar import arguments_schema, tool_grammar


def _ready(engine: GrammarEngine | None) -> GrammarEngine:
    if engine is None:
        raise ApiError(503, "this node has no grammar engine yet", "not_ready", retry_after="2")
    return engine


async def response_grammar(engine: GrammarEngine | None, response_format: oa.ResponseFormat | None) -> str | None:
    """The grammar a structured output asks for (``None``: free text), checked by the engine (400 if not)."""
    if response_format is None or isinstance(response_format, oa.TextFormat):
        return None
    engine = _ready(engine)
    schema = response_format.json_schema.json_schema if isinstance(response_format, oa.JsonSchemaFormat) else None
    param = "response_format.json_schema.schema" if isinstance(response_format, oa.JsonSchemaFormat) \
        else "response_format"
    try:
        grammar = grammar_for_schema(schema)
        await asyncio.to_thread(engine.check, grammar)
    except GrammarError as exc:
        raise ApiError(400, str(exc), "invalid_schema", param) from None
    return grammar


def check_tools_supported(tokenizer: HeadTokenizer, model_id: str) -> None:
    """Refuse (400) a request that offers tools the served model cannot be shown."""
    if not tokenizer.supports_tools:
        raise ApiError(400, f"tools cannot be used with {model_id}: the model's chat template has no "
                            "tool support (it never renders a tools list); send tool_choice 'none' or no tools",
                       "unsupported_parameter", "tools")


async def tools_grammar(engine: GrammarEngine | None, parsed: oa.ChatCompletionRequest) -> str:
    """The grammar of an answer with tools (:mod:`services.node.sampling.tool_grammar`), checked by the engine: a
    function whose parameters it cannot enforce is a 400 naming that function."""
    engine = _ready(engine)
    tools = parsed.tools or ()
    for index, tool in enumerate(tools):
        try:
            await asyncio.to_thread(engine.check, grammar_for_schema(arguments_schema(tool.function)))
        except GrammarError as exc:
            raise ApiError(400, f"the parameters of function {tool.function.name!r}: {exc}", "invalid_schema",
                           f"tools[{index}].function.parameters") from None
    grammar = tool_grammar(tools, parsed.tool_choice, parallel=parsed.parallel_tool_calls is not False)
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"the tools' grammar is {len(grammar)} characters, over the {MAX_GRAMMAR_CHARS} "
                            "that travel along a route; offer fewer tools or smaller parameters schemas",
                       "invalid_schema", "tools")
    try:
        await asyncio.to_thread(engine.check, grammar)
    except GrammarError as exc:
        raise ApiError(400, f"the tools cannot be enforced: {exc}", "invalid_schema", "tools") from None
    return grammar
