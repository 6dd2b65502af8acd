"""Sharing one machine's cores between the node processes on it.

A node on a CPU runs each forward with torch intra-op threads, and its
OpenMP worker threads spin a short while after each parallel region
(``GOMP_SPINCOUNT``, see :mod:`services.node.engine.openmp`), which is what lets a decode
step's few hundred small kernels run back to back without a futex wake each.
Alone on its machine, a node should use every core. Several nodes on one
machine (a local mesh, ``meshnet up``, the test suite) that each used every
core at the same time would run twice the threads there are cores: a thread
spinning for a partner the kernel has descheduled burns the partner's time
slice, and measured on 2 cores, 4 concurrent streams over a 2-node mesh fell
from 34 to 5 tokens/s.

So the cores are slots, one per core, held as byte-range locks (``lockf``)
of a file every co-located node names (``MESHNET_CPU_LOCK``). For each
forward (one prompt chunk or one decode step) a node takes slots and runs
with one thread per slot held:

* every free slot (up to its own thread count) when it did not have to
  wait: a single stream's hops compute one after another, each with every
  core, as if alone;
* only the slot it waited for when all were taken: under concurrent load the
  nodes settle on a share each and compute side by side, never more threads
  than cores;
* at most half the slots for :data:`CONTENTION_MEMORY_S` after a forward of
  its own met another node's (a slot taken, or a wait), even when every slot
  is free at that moment: two streams through a 2-node mesh keep both nodes
  busy, each step's forward on one node while the other's runs beside it.
  Taking every free core whenever the other node was between two steps made
  that node wait for the whole next step instead (2 streams: 56 tokens/s in
  aggregate against 84 with a core pinned to each node, ``benchmarks
  concurrency`` on 2 cores). A lone stream never meets the other node's
  forward, so it keeps every core.

The kernel releases the locks of a process that dies, so a crashed node
never blocks the others. On a machine of its own a node takes its slots
uncontended, at the cost of a few system calls a forward.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

logger = logging.getLogger(__name__)

DISABLED_VALUES: Final = frozenset({"", "off", "none"})
"""``MESHNET_CPU_LOCK`` values that turn sharing off (each node computes whenever it likes)."""
LOCK_FILE_MODE: Final = 0o666
"""Nodes run by different users on one machine can all open the lock file."""
CONTENTION_MEMORY_S: Final = 0.5
"""How long a node keeps to half the slots after its forward met another node's: tens of decode steps,
so a steady concurrent load stays shared, and a lone stream after it has every core again within a second."""


def machine_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's CPU set narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity masks
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Share:
    """What one forward got: ``threads`` to run with, after ``waited_s`` seconds of waiting for them."""

    threads: int
    waited_s: float


class CpuGate:
    """The core slots of one machine; :meth:`hold` takes a share of them for the duration of a forward.

    ``slots`` must be the same in every node sharing the file (each uses its
    machine's core count). One gate belongs to one node's compute thread; an
    in-process lock keeps it correct should two threads ever use it.
    """

    def __init__(self, path: str, slots: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.slots = slots if slots is not None else machine_cores()
        self._clock = clock
        self._contended_at: float | None = None
        """When a forward of this node last met another node's (took fewer slots than free, or waited)."""
        self._local = threading.Lock()
        self._first = os.getpid() % self.slots
        """Where this process starts looking for a free slot (processes spread over the slots)."""
        self._fd = _open_lock_file(path)

    @property
    def enabled(self) -> bool:
        """False when the lock file could not be opened (the node then computes with all its threads)."""
        return self._fd is not None

    @property
    def sharing(self) -> bool:
        """Whether a forward of this node met another node's within :data:`CONTENTION_MEMORY_S`."""
        return self._contended_at is not None and self._clock() - self._contended_at < CONTENTION_MEMORY_S

    @contextlib.contextmanager
    def hold(self, max_threads: int) -> Iterator[Share]:
        """Hold a share of the slots (at most ``max_threads``) for the block."""
        began = time.perf_counter()
        with self._local:
            if self._fd is None:
                yield Share(threads=max_threads, waited_s=0.0)
                return
            fd = self._fd
            limit = max_threads if not self.sharing else max(1, min(max_threads, self.slots // 2))
            held: list[int] = []
            contended = False
            for offset in range(self.slots):
                slot = (self._first + offset) % self.slots
                if len(held) >= limit:  # look whether another node computes now (a free slot is let go at once)
                    if _try_lock(fd, slot):
                        _unlock(fd, slot)
                    else:
                        contended = True
                    continue
                if _try_lock(fd, slot):
                    held.append(slot)
                else:
                    contended = True
            waited = 0.0
            if not held:
                _lock(fd, self._first)
                held = [self._first]
                waited = time.perf_counter() - began
            if contended:
                self._contended_at = self._clock()
            try:
                yield Share(threads=len(held), waited_s=waited)
            finally:
                for slot in held:
                    _unlock(fd, slot)

    def close(self) -> None:
        """Release the lock file (shutdown)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def cpu_gate_for(setting: str, device_type: str) -> CpuGate | None:
    """The gate a node on ``device_type`` uses under the ``MESHNET_CPU_LOCK`` value ``setting``, if any.

    GPUs schedule their own work, so only CPU nodes share slots.
    """
    if device_type != "cpu" or setting.strip().lower() in DISABLED_VALUES:
        return None
    gate = CpuGate(setting)
    if gate.enabled:
        logger.info("sharing this machine's %d cores with other nodes on it through %s", gate.slots, setting)
    return gate


def _try_lock(fd: int, slot: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
    except OSError:
        return False
    return True


def _lock(fd: int, slot: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, slot)


def _unlock(fd: int, slot: int) -> None:
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, slot)


def _open_lock_file(path: str) -> int | None:
    """A read-write descriptor of ``path``, created if missing; ``None`` (and a warning) when impossible."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, LOCK_FILE_MODE)
    except OSError as exc:
        logger.warning("cannot open the CPU lock %s (%s): this node computes with all its threads without "
                       "sharing the cores with other nodes on this machine", path, exc.strerror or exc)
        return None
    with contextlib.suppress(OSError):  # umask may have narrowed the mode; only the creator can widen it
        os.fchmod(fd, LOCK_FILE_MODE)
    return fd
