"""Fault injection (``--fault``): a node that computes wrong on purpose, for tests and demonstrations.

A mesh of machines owned by different people must catch a node that returns
wrong hidden states or tokens (issue 37); this module is the wrong node.
``corrupt-output:P`` adds visible noise to the hidden states a hop sends on in
a fraction ``P`` of its steps; a tail, which sends no hidden states on, adds it
to the hidden states its layers take in instead, so its layers' result (the
token it answers, its KV cache) is wrong as a broken GPU's would be; a node
holding every layer (token ids in, a token out) has no hidden states to
corrupt. ``wrong-token:P`` makes a tail answer another token than the one it
sampled in a fraction ``P`` of its steps (its layers computed right).

Which steps are hit, and how, is drawn from a RNG seeded by the fault's kind
and the step's first position alone, never by the session id (random), arrival
order or batching: the same request sent twice meets the same faults, so a
test is reproducible; a fraction ``P`` of a session's positions are hit. Settings refuse ``--fault``
unless ``MESHNET_ALLOW_FAULTS=1`` is set (:mod:`services.node.settings`).
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Final

import torch

from services.node.metrics import NodeMetrics
from services.node.settings import FaultSpec

logger = logging.getLogger(__name__)

NOISE_SCALE: Final = 1.0
"""Gaussian noise added to a corrupted frame, in units of the frame's own root-mean-square: far beyond any
rounding, so a corrupted step is visible in the answer and to any comparison."""
MIN_NOISE: Final = 1e-3
"""Noise floor (absolute), so that an all-zero frame is corrupted too."""


def _rng(position: int, kind: str) -> random.Random:
    """The RNG of the step at ``position`` for one fault kind (the same in every session and on every run)."""
    digest = hashlib.blake2b(f"{kind}\0{position}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


class FaultInjector:
    """Applies a node's ``--fault`` where its output leaves it; a no-op without one."""

    def __init__(self, spec: FaultSpec | None, metrics: NodeMetrics) -> None:
        self.spec = spec
        self._metrics = metrics
        if spec is not None:
            logger.warning("FAULT INJECTION ON (%s): this node answers wrong on purpose", spec)

    def hidden(self, position: int, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` as sent on (at a tail: as taken in): perturbed when ``corrupt-output`` picks this step, else
        unchanged (the same object)."""
        spec = self.spec
        if spec is None or spec.kind != "corrupt-output":
            return hidden
        rng = _rng(position, spec.kind)
        if rng.random() >= spec.rate:
            return hidden
        generator = torch.Generator().manual_seed(rng.getrandbits(63))
        noise = torch.randn(hidden.shape, generator=generator, dtype=torch.float32)
        scale = max(float(hidden.detach().float().pow(2).mean().sqrt()), MIN_NOISE) * NOISE_SCALE
        self._metrics.faults_injected.labels(kind=spec.kind).inc()
        return (hidden.float() + noise.to(hidden.device) * scale).to(hidden.dtype)

    def token(self, position: int, token: int, vocab_size: int) -> int:
        """The token a tail answers: another one than ``token`` when ``wrong-token`` picks this step."""
        spec = self.spec
        if spec is None or spec.kind != "wrong-token" or vocab_size < 2:
            return token
        rng = _rng(position, spec.kind)
        if rng.random() >= spec.rate:
            return token
        self._metrics.faults_injected.labels(kind=spec.kind).inc()
        return (token + rng.randrange(1, vocab_size)) % vocab_size
