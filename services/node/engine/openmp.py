"""How OpenMP worker threads of a node wait between parallel regions: set before torch loads.

A node's threads spin for ``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT` rounds,
then sleep (``OMP_WAIT_POLICY=PASSIVE`` says sleep rather than spin for long).

A decode step is a few hundred small kernels with a little Python between
them. Threads that sleep at once must be woken by a futex for every kernel:
measured on a 2-core machine, a SmolLM2 decode step took 35 ms that way
against 20 ms with a short spin. Threads that spin for long (libgomp's
default, 300,000 rounds: 5 ms of CPU after each parallel region, measured)
keep a core busy well after the node's step ended, which is the next node's
time on a shared machine. A short spin covers the gaps inside a step
(10,000 rounds gave the full speed, 1,000 did not) and costs about 0.1 ms of
CPU after it. Nodes sharing a machine also take turns through
:mod:`services.node.engine.cpu_gate`, so their spinning threads never wait on each
other.

libgomp reads these variables once, when torch loads it, so they must be in
the environment before the first ``import torch`` of the process. Nothing
here runs on import: ``meshnet node`` (:mod:`services.node.server`) calls
:func:`configure` before it imports the node, ``meshnet up`` and the test and
benchmark launchers pass :data:`OPENMP_DEFAULTS` to the processes they start,
and the container image sets them. A node started some other way (a bare
``uvicorn services.node.app:app``) logs how to set them when they are missing
(:func:`missing`). Only GNU OpenMP (the runtime of PyPI's torch wheels) reads
``GOMP_SPINCOUNT``; other runtimes see only the passive policy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from typing import Final

SPIN_COUNT: Final = "10000"
"""Busy-wait rounds of an idle OpenMP thread before it sleeps (about 0.1 ms on the development machine)."""
OPENMP_DEFAULTS: Final[Mapping[str, str]] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SPIN_COUNT}
"""What a node's process should start with, unless the operator chose otherwise."""


def configure(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put :data:`OPENMP_DEFAULTS` into ``environ`` where it says nothing else (call before torch loads)."""
    for name, value in OPENMP_DEFAULTS.items():
        environ.setdefault(name, value)


def missing(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The OpenMP settings this process started without (it runs, with torch's default waiting)."""
    return [name for name in OPENMP_DEFAULTS if name not in environ]
