"""What the tracker says about a node's last failure: one word of a fixed vocabulary, never what answered.

A failure reason is made from what a node's endpoint answered (an exception's
text, a status line, an error message) or what another node reported. The
endpoint is the registering node's choice: pointed at an internal service, the
words that service answered came back to anyone reading ``GET /v1/nodes``
(issue 34, finding 10). So ``last_failure_reason`` is one of
:data:`FAILURE_KINDS`, chosen by :func:`failure_kind` from the reason; the
reason itself only goes to the tracker's log.
"""

from __future__ import annotations

import re
from typing import Final, Literal

FailureKind = Literal["refused", "timeout", "unreachable", "reset", "http_4xx", "http_5xx", "bad_answer",
                      "broke_mid_answer", "failed"]
FAILURE_KINDS: Final[tuple[FailureKind, ...]] = ("refused", "timeout", "unreachable", "reset", "http_4xx",
                                                 "http_5xx", "bad_answer", "broke_mid_answer", "failed")
_STATUS: Final = re.compile(r"\b(?:answered|HTTP|status)\s+([1-5])[0-9]{2}\b", re.IGNORECASE)


def failure_kind(reason: str | None) -> FailureKind:
    """The word of :data:`FAILURE_KINDS` that says what kind of failure ``reason`` describes."""
    text = (reason or "").strip()
    for kind in FAILURE_KINDS:
        if text == kind:
            return kind
    lowered = text.lower()
    if lowered.startswith("broke mid-answer"):
        return "broke_mid_answer"
    if "timeout" in lowered or "timed out" in lowered:
        return "timeout"
    if "refused" in lowered:
        return "refused"
    if "reset" in lowered:
        return "reset"
    if ("connecterror" in lowered or "unreachable" in lowered or "could not be reached" in lowered
            or "name or service" in lowered or "no route" in lowered):
        return "unreachable"
    status = _STATUS.search(text)
    if status is not None and status.group(1) in "45":
        return "http_4xx" if status.group(1) == "4" else "http_5xx"
    if "content type" in lowered or "not an openai" in lowered or "no body" in lowered:
        return "bad_answer"
    return "failed"
