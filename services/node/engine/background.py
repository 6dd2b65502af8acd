"""Threads for a node's background work, at a lower CPU priority than its decode steps.

A decode node that pulls a long prompt's KV (:mod:`services.node.pd.kv_pull`)
receives tens of megabytes and copies them into a cache while it keeps
decoding the streams it already serves. At the same priority the operating
system shares the core evenly between the two, so every stream's time
between tokens stretches for as long as the pull lasts; in the PD benchmark
(``python -m benchmarks.pd``) the ongoing streams' p99 went from 33 to 73 ms
while 2,048-token prompts were handed over. The pull has no such deadline: a
few hundred milliseconds more for the new request's first decoded token
against every other stream's next one.

:class:`BackgroundPool` runs such work on threads that lower their own
priority by ``nice`` steps when they start (Linux gives each thread its own
nice value; ``os.setpriority`` on the thread's id). Under the kernel's fair
scheduler a thread at nice 10 gets about a tenth of a core that a nice-0
thread also wants, and the whole core when nothing else runs, so an idle
node pulls at full speed and a busy one keeps decoding. Where the priority
cannot be changed (another OS, a sandbox refusing it), the work runs at the
normal priority and the log says so once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from services.node.settings import MAX_NICE

logger = logging.getLogger(__name__)

T = TypeVar("T")



class BackgroundPool:
    """A bounded pool of lower-priority threads (``nice`` 0 keeps the node's own priority)."""

    def __init__(self, name: str, *, workers: int, nice: int, setup: Callable[[], None] | None = None) -> None:
        if not 0 <= nice <= MAX_NICE:
            raise ValueError(f"nice must be 0..{MAX_NICE}, got {nice}")
        self.nice = nice
        self._setup = setup
        """Run first on each thread (a node keeps torch to one thread there: ``compute.one_torch_thread``)."""
        self._warned = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name,
                                                           initializer=self._lower_priority)

    def submit(self, work: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``work`` on one of the pool's threads."""
        return self._pool.submit(work)

    def shutdown(self) -> None:
        """Stop taking work; the running work finishes on its own (no wait)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _lower_priority(self) -> None:
        if self._setup is not None:
            self._setup()
        if self.nice == 0:
            return
        try:
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, thread) + self.nice))
        except (AttributeError, OSError) as exc:
            if not self._warned.is_set():
                self._warned.set()
                logger.warning("background work runs at the node's own priority (could not lower it by %d: %s)",
                               self.nice, exc)
