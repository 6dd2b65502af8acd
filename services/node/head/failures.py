"""How a generation fails: the errors the head's loop raises, and what the API answers for each.

:class:`GenerationFailed` carries the HTTP status and code the API answers; its subclasses say what the
loop may still do about it: route around a failed hop (:class:`RouteFailed`), try another route for a busy
one (:class:`RouteBusy`), or prefill the prompt itself when a handoff's or a fork's KV is refused
(:class:`HandoffRefused`, :class:`ForkRefused`).
"""

from __future__ import annotations

from services.node.hop.hop_client import INVALID_SAMPLING, ChainFailure


class GenerationFailed(Exception):
    """The request could not be completed; ``status``/``code`` are what the API answers."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: str | None = None,
                 failed_node: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after
        self.failed_node = failed_node


class RouteFailed(GenerationFailed):
    """A hop of the route failed (unreachable, crashed, lost the session): failover can route around it."""

    def __init__(self, failed_node: str, message: str) -> None:
        super().__init__(502, "hop_failed", message, failed_node=failed_node)


class HandoffRefused(GenerationFailed):
    """The decode route could not take a prefill handoff's KV over (``reason``): it prefills the prompt itself."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(409, "handoff_failed", message)
        self.reason = reason


class ForkRefused(Exception):
    """A session could not be opened as a fork of another (this head or a hop refused): prefill instead."""


class RouteBusy(GenerationFailed):
    """A hop of the route refused the session for load (503 ``kv_budget``...): another route may take it."""

    def __init__(self, busy_node: str, code: str, message: str, retry_after: str | None) -> None:
        super().__init__(503, code, message, retry_after=retry_after)
        self.busy_node = busy_node


def generation_failure(exc: ChainFailure) -> GenerationFailed:
    """What a failed step along the route means to the loop: the caller's fault, a failed hop, or a busy one."""
    if exc.client_fault:
        return GenerationFailed(exc.status, str(exc.body.get("error", {}).get("code") or INVALID_SAMPLING), str(exc))
    if exc.failed_node is not None:
        return RouteFailed(exc.failed_node, str(exc))
    code = str(exc.body.get("error", {}).get("code") or "kv_budget")
    return RouteBusy(exc.busy_node or "unknown", code, str(exc), exc.retry_after)

