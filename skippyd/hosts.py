"""Which machine a topology's host is: by its addresses, not by how it is written.

A topology may name one machine in several ways (``127.0.0.1``, ``localhost``, its host name, its LAN
address, two DNS names of one box). The daemon counts machines to choose its defaults (decode groups:
one per machine; how many stages share this machine's cores), so two names of one machine must count
once. A name that does not resolve counts as itself.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

__all__ = ["THIS_MACHINE", "Machines", "is_local_address"]

THIS_MACHINE = "this machine"

Resolver = Callable[[str], list[str]]


def resolve_addresses(host: str) -> list[str]:
    """Every address `host` resolves to (raises OSError if it does not)."""
    return [info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]


def is_local_address(address: str) -> bool:
    """Whether `address` is one of this machine's own: a socket can be bound to it."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


class Machines:
    """``of(host)``: a key naming the machine `host` is; :data:`THIS_MACHINE` for this one. Each host is
    resolved once (a daemon asks at startup, before it serves)."""

    def __init__(self, resolve: Resolver = resolve_addresses,
                 is_local: Callable[[str], bool] = is_local_address):
        self._resolve = resolve
        self._is_local = is_local
        self._known: dict[str, str] = {}

    def of(self, host: str) -> str:
        key = self._known.get(host)
        if key is None:
            key = self._known[host] = self._key(host)
        return key

    def count(self, hosts: list[str]) -> int:
        """How many machines `hosts` are on."""
        return len({self.of(h) for h in hosts})

    def _key(self, host: str) -> str:
        name = host.strip("[]").lower()
        if name == "localhost" or self._is_local(name):
            return THIS_MACHINE
        try:
            addresses = sorted(set(self._resolve(name)))
        except (OSError, UnicodeError):
            return name  # unresolvable here: the name stands for its machine
        if not addresses:
            return name
        if any(self._is_local(a) for a in addresses):
            return THIS_MACHINE
        # a machine with several addresses: its IPv4 one, the smallest, names it (two of its names usually
        # share that one even when only one of them has an IPv6 address too)
        v4 = [a for a in addresses if ":" not in a]
        return (v4 or addresses)[0]
