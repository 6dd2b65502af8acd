"""Which addresses a node may register: never cloud metadata or link-local, private ones by the operator's choice.

The tracker POSTs to every registered ``endpoint`` (the front door's requests,
with its signature) and hands it and ``relay_addr`` to other nodes, which
dial them. A member that registers ``http://169.254.169.254`` or a router's
``http://10.0.0.1`` makes the tracker and its peers call that address (issue
34, finding 10). :func:`address_problem` refuses, at registration:

- always: cloud metadata, link-local, unspecified, multicast and reserved
  addresses, and the metadata host names (:mod:`meshwire.targets`);
- with ``MESHNET_ALLOW_PRIVATE_ENDPOINTS=0``: loopback and private ranges too
  (a mesh of machines on the public internet). It is on by default: a LAN
  mesh, ``meshnet up`` on one machine and the compose file all register
  private addresses, and their nodes are the operator's own.

A host name is resolved (at most :data:`RESOLVE_TIMEOUT_S`, answers kept
:data:`RESOLVED_TTL_S`) and refused when any address it resolves to is; a name
that does not resolve now is judged by its text. The check holds at
registration: a name whose DNS answer changes afterwards (rebinding) is caught
at the node's next heartbeat, each of which re-registers it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import OrderedDict
from typing import Final

from meshwire.targets import forbidden_target, host_of, private_target, resolved_problem

RESOLVE_TIMEOUT_S: Final = 2.0
RESOLVED_TTL_S: Final = 30.0
MAX_RESOLVED: Final = 1024
"""Host names whose addresses are kept (the oldest are forgotten first)."""


class EndpointPolicy:
    """Checks the addresses a node registers (``allow_private``: ``MESHNET_ALLOW_PRIVATE_ENDPOINTS``)."""

    def __init__(self, *, allow_private: bool) -> None:
        self.allow_private = allow_private
        self._resolved: OrderedDict[str, tuple[float, tuple[str, ...]]] = OrderedDict()

    async def address_problem(self, address: str) -> str | None:
        """Why a node may not register ``address`` (a URL); ``None`` when it may."""
        problem = forbidden_target(address)
        if problem is None and not self.allow_private:
            problem = private_target(address)
        if problem is not None:
            return problem
        host = host_of(address)
        if _is_ip(host):
            return None
        return resolved_problem(await self._resolve(host), allow_private=self.allow_private)

    async def _resolve(self, host: str) -> tuple[str, ...]:
        now = time.monotonic()
        kept = self._resolved.get(host)
        if kept is not None and now - kept[0] < RESOLVED_TTL_S:
            return kept[1]
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            addresses = tuple(sorted({str(info[4][0]) for info in infos}))
        except (OSError, TimeoutError, UnicodeError):
            addresses = ()
        self._resolved[host] = (now, addresses)
        self._resolved.move_to_end(host)
        while len(self._resolved) > MAX_RESOLVED:
            self._resolved.popitem(last=False)
        return addresses


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host.split("%", 1)[0])
    except OSError:
        return False
    return True
