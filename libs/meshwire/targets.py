"""Which addresses a mesh service may be made to call: no cloud metadata, no link-local, and (by choice) no
private network.

A node registers its own ``endpoint`` and ``relay_addr`` with the tracker, and
the tracker and other nodes then send requests there. An address chosen by a
participant is an SSRF unless it is checked: ``169.254.169.254`` answers a
cloud machine's credentials, and ``10.0.0.1`` may be a router's admin page.

- :func:`forbidden_target`: always refused, whatever the operator says: the
  unspecified address (``0.0.0.0``, ``::``), link-local (``169.254.0.0/16``,
  ``fe80::/10``, where the metadata services live: ``169.254.169.254``,
  ``fd00:ec2::254``), multicast and broadcast, and the metadata host names
  (``metadata.google.internal``...).
- :func:`private_target`: loopback and private ranges (``127.0.0.0/8``,
  ``10.0.0.0/8``, ``172.16.0.0/12``, ``192.168.0.0/16``, ``100.64.0.0/10``,
  ``::1``, ``fc00::/7``); a tracker refuses them when
  ``MESHNET_ALLOW_PRIVATE_ENDPOINTS`` is off (a public mesh), and allows them
  by default (a LAN or a laptop, where every node has such an address).

A host name is judged by the addresses it resolves to when the caller resolves
it (:func:`resolved_problem`); a name that does not resolve is judged by its
text only.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit

METADATA_ADDRESSES: Final = frozenset({
    ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("169.254.170.2"),
    ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200"),
})
"""Cloud metadata services (AWS, GCP, Azure, ECS, Alibaba): never a node."""
METADATA_NAMES: Final = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                                   "instance-data.ec2.internal"})
CARRIER_NAT: Final = ipaddress.ip_network("100.64.0.0/10")

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def host_of(address: str) -> str:
    """The host of a URL (``scheme://host[:port]/...``), brackets and case dropped; ``""`` when it has none."""
    try:
        return (urlsplit(address).hostname or "").lower().rstrip(".")
    except ValueError:
        return ""


def _ip(host: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def ip_forbidden(ip: IpAddress) -> str | None:
    """Why no service may be made to call ``ip`` (``None``: nothing forbids it)."""
    if ip in METADATA_ADDRESSES:
        return f"{ip} is a cloud metadata address"
    if ip.is_link_local:
        return f"{ip} is link-local"
    if ip.is_unspecified:
        return f"{ip} is the unspecified address"
    if ip.is_multicast or (isinstance(ip, ipaddress.IPv4Address) and ip == ipaddress.IPv4Address("255.255.255.255")):
        return f"{ip} is multicast or broadcast"
    if ip.is_reserved and not ip.is_private:
        return f"{ip} is reserved"
    return None


def ip_private(ip: IpAddress) -> bool:
    """Whether ``ip`` is loopback or in a private (or carrier-grade NAT) range."""
    return ip.is_loopback or ip.is_private or (isinstance(ip, ipaddress.IPv4Address) and ip in CARRIER_NAT)


def forbidden_target(address: str) -> str | None:
    """Why ``address`` (a URL) may never be called, by its text; ``None`` when nothing forbids it."""
    host = host_of(address)
    if not host:
        return "it names no host"
    if host in METADATA_NAMES:
        return f"{host} is a cloud metadata host"
    ip = _ip(host)
    return None if ip is None else ip_forbidden(ip)


def private_target(address: str) -> str | None:
    """Why ``address`` (a URL) is on a private network by its text (``localhost`` too); ``None`` otherwise."""
    host = host_of(address)
    if host == "localhost" or host.endswith(".localhost"):
        return f"{host} is loopback"
    ip = _ip(host)
    return f"{ip} is a loopback or private address" if ip is not None and ip_private(ip) else None


def resolved_problem(addresses: Iterable[str], *, allow_private: bool) -> str | None:
    """Why a host that resolves to ``addresses`` may not be called; ``None`` when every one may."""
    for text in addresses:
        ip = _ip(text)
        if ip is None:
            continue
        problem = ip_forbidden(ip)
        if problem is None and not allow_private and ip_private(ip):
            problem = f"{ip} is a loopback or private address"
        if problem is not None:
            return f"it resolves to {problem}"
    return None
