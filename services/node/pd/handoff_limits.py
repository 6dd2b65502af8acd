"""The bounds on KV a prefill node holds for handoffs: how many, how many bytes (the TTL is the session table's)."""

from __future__ import annotations

from dataclasses import dataclass

from services.node.engine.sessions import SessionRefused, SessionTable


@dataclass(frozen=True)
class HandoffLimits:
    """``max_held`` handoffs and ``max_bytes`` of their KV at once; ``position_bytes`` is one position of
    one layer (K and V)."""

    max_held: int
    max_bytes: int
    position_bytes: int

    def check_room(self, sessions: SessionTable, tokens: int, layers: int) -> None:
        """Refuse (503 ``kv_budget``, so callers treat it as busy) a new handoff of ``tokens`` positions on ``layers``
        layers that would go over either bound."""
        if sessions.handoffs >= self.max_held:
            raise SessionRefused("kv_budget", f"this node holds its maximum of {self.max_held} handoffs")
        needed = tokens * layers * self.position_bytes
        held = sessions.handoff_bytes()
        if held + needed > self.max_bytes:
            raise SessionRefused("kv_budget", f"a handoff of {needed} bytes of KV does not fit: {held} of "
                                              f"{self.max_bytes} bytes are held for handoffs")
