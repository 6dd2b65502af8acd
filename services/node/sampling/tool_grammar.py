"""The grammar of an answer that may, or must, call tools: a Lark grammar for llguidance.

Each function's call is written as :mod:`meshwire.tool_calls` reads it
(Hermes / Qwen2.5: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``),
with its arguments a JSON value of the function's ``parameters`` schema
(llguidance's ``%json``, compact as structured outputs are). ``tool_choice``
picks the start rule:

- ``auto``: free text, or free text and then tool calls. The text before a
  call is a lazy lexeme ending at the first ``<tool_call>``, so once the
  model writes the tag the call's grammar holds it (text can never hold the tag);
- ``required``: one or more calls and nothing else;
- a named function: exactly one call of it.

``parallel_tool_calls: false`` allows one call at most. After the last call
only the end of the answer may come. The grammar travels to the tail in
``X-Meshnet-Sampling`` like a structured output's and follows failover the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Final

import llguidance

from meshwire import openai as oa
from meshwire.tool_calls import ARGUMENTS_OPEN, CALL_CLOSE, CALL_NAME_END, CALL_OPEN, CALL_SEPARATOR, TAG_OPEN

NO_PARAMETERS: Final = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function declared without ``parameters``: OpenAI's "empty parameter list"."""
COMPACT_JSON: Final = {"whitespace_flexible": False}
"""Arguments as compact JSON, as structured outputs write them (:data:`services.node.sampling.grammar.JSON_OPTIONS`)."""


def arguments_schema(function: oa.FunctionSpec) -> dict[str, Any]:
    """The schema a call's arguments follow (with the compact-JSON option llguidance reads in ``x-guidance``)."""
    return {**(NO_PARAMETERS if function.parameters is None else function.parameters), "x-guidance": COMPACT_JSON}


def _literal(text: str) -> str:
    """A Lark string literal (JSON string syntax, which llguidance's Lark reads)."""
    return json.dumps(text)


def _call_rule(index: int, function: oa.FunctionSpec) -> str:
    """``call_<index>``: one call of ``function``, after its ``<tool_call>`` tag."""
    head = CALL_OPEN[len(TAG_OPEN):] + function.name + CALL_NAME_END + ARGUMENTS_OPEN
    schema = json.dumps(arguments_schema(function), separators=(",", ":"))
    return f"call_{index}: {_literal(head)} %json {schema} {_literal(CALL_CLOSE)}"


def tool_lark(tools: Sequence[oa.ToolSpec], choice: oa.ToolChoice | None, *, parallel: bool = True) -> str:
    """The Lark grammar of an answer to a request with ``tools`` and ``tool_choice`` (not ``none``)."""
    functions = [tool.function for tool in tools]
    lines = ["%llguidance {}"]
    if isinstance(choice, oa.NamedToolChoice):
        index = next(i for i, function in enumerate(functions) if function.name == choice.function.name)
        lines.append(f"start: {_literal(TAG_OPEN)} call_{index}")
        lines.append(_call_rule(index, functions[index]))
        return "\n".join(lines)
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    lines.extend(_call_rule(i, function) for i, function in enumerate(functions))
    lines.append(f"calls: call ({_literal(CALL_SEPARATOR + TAG_OPEN)} call)*" if parallel else "calls: call")
    if choice == "required":
        lines.append(f"start: {_literal(TAG_OPEN)} calls")
    else:  # auto (the default with tools)
        lines.append("start: TEXT | lead calls")
        lines.append(f"lead[lazy]: TEXT {_literal(TAG_OPEN)}")
        lines.append(r"TEXT: /(.|\n)*/")
    return "\n".join(lines)


def tool_grammar(tools: Sequence[oa.ToolSpec], choice: oa.ToolChoice | None, *, parallel: bool = True) -> str:
    """:func:`tool_lark` as the grammar the tail's engine takes."""
    return llguidance.LLMatcher.grammar_from_lark(tool_lark(tools, choice, parallel=parallel))
