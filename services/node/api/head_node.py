"""What a head's OpenAI endpoints read of the node they serve: the :class:`HeadNode` protocol.

Named here, not imported, so the API wing never reaches up into the runtime that wires it
(``services.node.runtime.NodeRuntime`` is one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.node.head.generation import Generator
    from services.node.head.sampling_defaults import SamplingDefaults
    from services.node.hop.auth import HopAuth
    from services.node.hop.routing import TrackerRoutes
    from services.node.hop.trust import RouteTrust
    from services.node.model.shard import Shard
    from services.node.pd.kv_pull import KvPuller
    from services.node.sampling.grammar import GrammarEngine
    from services.node.settings import NodeSettings, NodeState


class HeadNode(Protocol):
    """What the OpenAI endpoints read of the node they serve."""

    node_id: str
    model_id: str
    state: NodeState
    settings: NodeSettings
    shard: Shard | None
    generator: Generator | None
    grammar: GrammarEngine | None
    puller: KvPuller | None
    sampling_defaults: SamplingDefaults
    tracker_routes: TrackerRoutes
    trust: RouteTrust
    hop_auth: HopAuth
