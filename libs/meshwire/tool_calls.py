"""Tool calls in a model's text, and OpenAI's ``tool_calls`` built from them.

The mesh writes tool calls in the Hermes / Qwen2.5 format, the one
tool-calling chat templates of that family render and their models are
trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(several calls are separated by one newline; free text may come before the
first in ``tool_choice: auto``). The head's grammar (``services.node.sampling.tool_grammar``)
makes the model write exactly :data:`CALL_OPEN` ``name`` :data:`ARGUMENTS_OPEN`
``arguments`` :data:`CALL_CLOSE`, so the parser here reads that shape and
nothing looser.

:class:`ToolCallParser` turns the answer's text, piece by piece, into what
OpenAI streams: content text, and ``delta.tool_calls`` entries (the first of
each call with its id, type and name and ``arguments: ""``, then argument
fragments). What it has emitted after any text is a function of that text
alone, not of how it was cut into pieces: a head continuing a stream after
another died (``meshwire.resume``) feeds it the text already sent, discards
what it emits, and goes on exactly where the client is. No markup reaches the
client: text that may begin a tag is held back until it cannot.

:class:`ToolCallAssembler` adds such deltas up into the final ``tool_calls``
(the tracker assembling a non-streamed answer, the head its own).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Literal

logger = logging.getLogger(__name__)

TAG_OPEN: Final = "<tool_call>"
"""What starts a tool call in the text (in ``auto``, what ends the free text before it)."""
CALL_OPEN: Final = TAG_OPEN + '\n{"name": "'
CALL_NAME_END: Final = '"'
ARGUMENTS_OPEN: Final = ', "arguments": '
CALL_CLOSE: Final = "}\n</tool_call>"
CALL_SEPARATOR: Final = "\n"
"""Between two calls of one answer."""
CALL_ID_PREFIX: Final = "call_"
MAX_NAME_CHARS: Final = 64
"""A function name is at most this long (OpenAI's rule, which requests are checked against)."""

State = Literal["content", "name", "arguments_open", "arguments", "close", "between", "broken"]


def new_call_id() -> str:
    """A fresh tool call id such as ``call_3f2a...`` (OpenAI's shape)."""
    return f"{CALL_ID_PREFIX}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its position in the answer, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of call ``index``'s arguments (JSON text)."""

    index: int
    text: str


@dataclass(frozen=True)
class Parsed:
    """What one piece of text adds: content text, then tool call events, in order."""

    content: str = ""
    calls: tuple[CallStart | ArgumentsPiece, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def deltas(self) -> list[dict[str, Any]]:
        """The calls as OpenAI ``delta.tool_calls`` entries (pieces of one call merged)."""
        out: list[dict[str, Any]] = []
        for event in self.calls:
            if isinstance(event, CallStart):
                out.append({"index": event.index, "id": event.id, "type": "function",
                            "function": {"name": event.name, "arguments": ""}})
            elif out and out[-1]["index"] == event.index:
                out[-1]["function"]["arguments"] += event.text
            else:
                out.append({"index": event.index, "function": {"arguments": event.text}})
        return out


@dataclass
class _Json:
    """Where a streamed JSON value stands: nesting depth, inside a string, after a backslash."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def feed(self, char: str) -> bool:
        """Take one character; True when it closed the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return False
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            self.started = True
        elif char in "}]":
            self.depth -= 1
        return self.started and self.depth == 0


@dataclass
class ToolCallParser:
    """Content and tool calls out of an answer's text, as it streams (see the module docstring)."""

    calls: int = 0
    """Tool calls begun so far."""
    _state: State = "content"
    _held: str = ""
    """Text received and not yet emitted: a possible tag's beginning, a name, a literal being matched."""
    _json: _Json = field(default_factory=_Json)

    @property
    def called(self) -> bool:
        """True once the answer holds a tool call (its finish reason is then ``tool_calls``)."""
        return self.calls > 0

    def feed(self, text: str) -> Parsed:
        """Take the next piece of the answer's text; return what may go to the client now."""
        content: list[str] = []
        calls: list[CallStart | ArgumentsPiece] = []
        arguments: list[str] = []

        def flush_arguments() -> None:
            if arguments:
                calls.append(ArgumentsPiece(self.calls - 1, "".join(arguments)))
                arguments.clear()

        for char in text:
            state = self._state
            if state == "arguments":
                arguments.append(char)
                if self._json.feed(char):
                    flush_arguments()
                    self._state, self._held = "close", ""
                continue
            if state in ("content", "between"):
                self._held += char
                if CALL_OPEN.startswith(self._held) or (state == "between" and self._between_prefix()):
                    if self._held.endswith(CALL_OPEN):
                        self._begin_name()
                    continue
                if state == "between":  # not a separator and the next call: the model went off the format
                    self._break(content)
                    continue
                start = self._tag_start()
                content.append(self._held[:start])
                self._held = self._held[start:]
                continue
            if state == "name":
                if char == CALL_NAME_END:
                    calls.append(CallStart(self.calls, new_call_id(), self._held))
                    self.calls += 1
                    self._state, self._held = "arguments_open", ""
                elif len(self._held) >= MAX_NAME_CHARS:
                    self._break(content)
                    content.append(char)
                else:
                    self._held += char
                continue
            if state in ("arguments_open", "close"):
                literal = ARGUMENTS_OPEN if state == "arguments_open" else CALL_CLOSE
                self._held += char
                if not literal.startswith(self._held):
                    self._break(content)
                elif self._held == literal:
                    self._held = ""
                    if state == "arguments_open":
                        self._state, self._json = "arguments", _Json()
                    else:
                        self._state = "between"
                continue
            content.append(char)  # broken: the rest is text
        flush_arguments()
        return Parsed("".join(content), tuple(calls))

    def flush(self) -> Parsed:
        """At the end of the answer: held text that turned out to be content (a tag that never came)."""
        held, self._held = self._held, ""
        if self._state == "content":
            return Parsed(held)
        return Parsed()

    def _tag_start(self) -> int:
        """Where the held text's longest suffix that could begin :data:`CALL_OPEN` starts."""
        held = self._held
        for start in range(max(0, len(held) - len(CALL_OPEN) + 1), len(held) + 1):
            if CALL_OPEN.startswith(held[start:]):
                return start
        return len(held)

    def _between_prefix(self) -> bool:
        """Between calls: is the held text a prefix of the separator and the next call's opening?"""
        return (CALL_SEPARATOR + CALL_OPEN).startswith(self._held)

    def _begin_name(self) -> None:
        self._state, self._held = "name", ""

    def _break(self, content: list[str]) -> None:
        """The text left the tool call format (which the grammar rules out): the rest is content."""
        logger.warning("tool call text left the expected format after %d call(s): %r", self.calls, self._held[:80])
        content.append(self._held)
        self._state, self._held = "broken", ""


@dataclass
class ToolCallAssembler:
    """OpenAI ``delta.tool_calls`` entries added up into ``message.tool_calls``."""

    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, deltas: Any) -> None:
        """Take one chunk's ``delta.tool_calls`` (a list of dicts; anything malformed is skipped)."""
        for delta in deltas if isinstance(deltas, list | tuple) else ():
            if not isinstance(delta, dict) or not isinstance(delta.get("index"), int):
                continue
            call = self._calls.setdefault(delta["index"], {"id": "", "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
            if isinstance(delta.get("id"), str):
                call["id"] = delta["id"]
            function = delta.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    call["function"]["name"] = function["name"]
                if isinstance(function.get("arguments"), str):
                    call["function"]["arguments"] += function["arguments"]

    def result(self) -> list[dict[str, Any]] | None:
        """The tool calls in index order (``None``: there were none)."""
        return [self._calls[index] for index in sorted(self._calls)] or None
