"""What one relay app holds: its settings, its peer table, its metrics, its caller count."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.relay.metrics import RelayMetrics
from services.relay.peers import PeerTable
from services.relay.settings import RelaySettings


@dataclass
class RelayState:
    """The shared state of one relay; built once by :func:`services.relay.app.create_app`."""

    settings: RelaySettings
    peers: PeerTable
    metrics: RelayMetrics = field(default_factory=RelayMetrics)
    callers: int = 0
    """Caller connections (``/rpc`` and ``/mux``) open now."""

    @classmethod
    def build(cls, settings: RelaySettings) -> RelayState:
        return cls(settings=settings,
                   peers=PeerTable(max_peers=settings.max_peers, probe_timeout_s=settings.takeover_probe_s))
