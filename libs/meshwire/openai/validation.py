"""A request's validation error as the one sentence (and the ``param``) of a 400 answer.

pydantic reports every problem with a location path that includes its union
branches (``str``, ``tuple[...]``); the answer names the field a client wrote
(``messages[0].role``) and says what is wrong with it, as OpenAI's 400s do.
"""

from __future__ import annotations

from typing import Final

from pydantic import ValidationError

_UNION_MARKERS: Final = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "tuple"})


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _UNION_MARKERS:
            continue  # pydantic's union-branch markers (``str``, ``tuple[...]``): not field names
        else:
            out += f".{part}" if out else part
    return out


def validation_error_param(exc: ValidationError) -> str | None:
    """The field the first error is about (``messages[0].role``), for the error's ``param``."""
    errors = exc.errors(include_url=False)
    if not errors:
        return None
    return _location(tuple(errors[0]["loc"])) or None


def validation_error_message(exc: ValidationError) -> str:
    """One sentence naming the offending field and what is wrong with it."""
    errors = exc.errors(include_url=False)
    if not errors:
        return "invalid request body"
    first = errors[0]
    field = _location(tuple(first["loc"]))
    message = str(first["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if first["type"] == "extra_forbidden":
        sentence = f"unrecognized request argument supplied: {field}"
    elif first["type"] == "missing":
        sentence = f"missing required field '{field}'"
    elif first["type"] == "json_invalid":
        sentence = f"request body is not valid JSON ({message})"
    elif first["type"] in ("model_type", "model_attributes_type", "dict_type") and not field:
        sentence = "request body must be a JSON object"
    elif field:
        sentence = f"invalid value for '{field}': {message[0].lower() + message[1:] if message else message}"
    else:
        sentence = message[0].lower() + message[1:] if message else "invalid request body"
    more = len(errors) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{sentence}{suffix}"
