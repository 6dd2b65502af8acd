"""The node service: holds a contiguous range of a model's layers and serves them.

Before torch loads, a node sets how OpenMP worker threads wait between
parallel regions (unless the environment already says): they spin for
``GOMP_SPINCOUNT`` = :data:`SPIN_COUNT` rounds, then sleep
(``OMP_WAIT_POLICY=PASSIVE`` says sleep rather than spin for long).

A decode step is a few hundred small kernels with a little Python between
them. Threads that sleep at once must be woken by a futex for every kernel:
measured on this 2-core machine, a SmolLM2 decode step took 35 ms that way
against 20 ms with a short spin. Threads that spin for long (libgomp's
default, 300,000 rounds: 5 ms of CPU after each parallel region, measured)
keep a core busy well after the node's step ended, which is the next node's
time on a shared machine. A short spin covers the gaps inside a step
(10,000 rounds gave the full speed, 1,000 did not) and costs about 0.1 ms of
CPU after it. Nodes sharing a machine also take turns through
:mod:`services.node.cpu_gate`, so their spinning threads never wait on each
other.

Only GNU OpenMP (the runtime of PyPI's torch wheels) reads ``GOMP_SPINCOUNT``;
other runtimes see only the passive policy.
"""

import os
from typing import Final

SPIN_COUNT: Final = "10000"
"""Busy-wait rounds of an idle OpenMP thread before it sleeps (about 0.1 ms on the development machine)."""

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
