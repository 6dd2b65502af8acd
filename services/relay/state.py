"""What one relay app holds: its settings, its peer table, its metrics, its caller slots."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshwire.route_keys import KeySet
from services.relay.budgets import CallerSlots
from services.relay.hop_callers import HandshakeKeys
from services.relay.join_tokens import TokenChecker
from services.relay.metrics import RelayMetrics
from services.relay.peers import PeerTable
from services.relay.settings import RelaySettings


@dataclass
class RelayState:
    """The shared state of one relay; built once by :func:`services.relay.app.create_app`."""

    settings: RelaySettings
    peers: PeerTable
    callers: CallerSlots
    """Caller connections (``/rpc`` and ``/mux``) open now, by kind and address."""
    metrics: RelayMetrics = field(default_factory=RelayMetrics)
    tokens: TokenChecker | None = None
    """Checks join tokens with the tracker (``MESHNET_TRACKER``); ``None``: only the shared secret admits."""
    handshakes: HandshakeKeys | None = None
    """Verifies nodes' signed, peer-bound caller handshakes (route keys pinned or from the trackers)."""

    @classmethod
    def build(cls, settings: RelaySettings) -> RelayState:
        return cls(settings=settings,
                   peers=PeerTable(max_peers=settings.max_peers, probe_timeout_s=settings.takeover_probe_s),
                   callers=CallerSlots(max_authenticated=settings.max_callers,
                                       max_anonymous=settings.max_anonymous_callers,
                                       max_anonymous_per_address=settings.max_anonymous_callers_per_address),
                   tokens=TokenChecker(settings.tracker_urls()) if settings.tracker_urls() else None,
                   handshakes=HandshakeKeys(KeySet.parse(settings.route_keys) if settings.route_keys else KeySet(),
                                            settings.tracker_urls()))
