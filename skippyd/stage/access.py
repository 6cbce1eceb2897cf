"""Who may open a lane to a stage: an upstream address allow-list and an optional shared link secret.

A stage k > 0 accepts upstream connections only from the addresses allowed
here, checked before the handshake reads anything else: by default the host
that the topology names for stage k-1 (``upstream_allow`` / ``--upstream-allow``
replace that list; ``any`` turns the check off). A refused peer gets a
HelloReply with the reason and the stage logs one line; nothing else happens.

Loopback counts as one address: if the list allows any loopback address (or
an unspecified one, 0.0.0.0 or ::, which a dialer reaches through loopback),
every loopback address is allowed, so ``localhost`` resolving to ::1 while a
peer dials from 127.0.0.1 still works. Host names are resolved when a peer
connects (cached for RESOLVE_TTL_S); a name that does not resolve allows
nothing (fail closed) and is logged.

The link secret (``link_secret_file`` / ``--link-secret-file``) is read from a
file that every daemon of the pipeline holds. The Hello's auth field carries
a digest of it (the secret itself never goes on the wire), and every stage
with a secret refuses a Hello whose auth differs (``hmac.compare_digest``, see
skippyd.wire.handshake.check_hello). Links are not encrypted: the digest
keeps out peers that do not know the secret, not an eavesdropper who can
replay it; run links over a private network or a VPN.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
from collections.abc import Sequence
from pathlib import Path

import trio

from skippyd.topology import Topology, TopologyError, parse_allow_entry

log = logging.getLogger("skippyd.stage")

RESOLVE_TTL_S = 60.0
_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_AUTH_DOMAIN = b"skippy link secret v1\0"


class LinkSecretError(ValueError):
    """The link secret file cannot be used."""


def link_auth(secret: bytes) -> bytes:
    """What the Hello's auth field carries for `secret`: 32 bytes; empty for no secret."""
    return hashlib.sha256(_AUTH_DOMAIN + secret).digest() if secret else b""


def load_link_secret(path: Path) -> bytes:
    """The Hello auth value for the secret in `path` (surrounding whitespace ignored). Raises LinkSecretError."""
    try:
        data = Path(path).read_bytes().strip()
        mode = Path(path).stat().st_mode
    except OSError as exc:
        raise LinkSecretError(f"link secret file {path}: {exc.strerror or exc}") from None
    if len(data) < 16:
        raise LinkSecretError(f"link secret file {path}: the secret must be at least 16 bytes "
                              f"(e.g. `openssl rand -hex 32 > {path}`)")
    if mode & 0o077:
        log.warning("the link secret %s is readable by others (mode %o); chmod 600 it", path, mode & 0o777)
    return link_auth(data)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 scope (fe80::1%eth0)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
    return ip


def _widen(net) -> list:
    """A loopback or unspecified entry stands for every loopback address."""
    if net.network_address.is_loopback or net.network_address.is_unspecified:
        return [net, *_LOOPBACK] if not net.network_address.is_unspecified else list(_LOOPBACK)
    return [net]


class UpstreamAllow:
    """An upstream allow-list. ``entries`` as for :func:`skippyd.topology.parse_allow_entry`."""

    def __init__(self, entries: Sequence[str], *, source: str):
        self.entries = [str(e) for e in entries]
        self.source = source  # where the list came from, for the log and status
        self.any = False
        self._networks: list = []
        self._names: list[str] = []
        for entry in self.entries:
            parsed = parse_allow_entry(entry)
            if parsed is None:
                self.any = True
            elif isinstance(parsed, str):
                self._names.append(parsed)
            else:
                self._networks.extend(_widen(parsed))
        self._resolved: dict[str, tuple[float, list]] = {}

    @classmethod
    def for_stage(cls, topology: Topology, index: int, configured: Sequence[str] | None) -> UpstreamAllow:
        """The configured list, else the host the topology names for stage index-1; for stage 0 (the
        head, whose only listener takes the final stage's token-return connection) the final stage's."""
        if configured is not None:
            return cls(configured, source="upstream_allow")
        if len(topology.stages) < 2:
            raise TopologyError("a single-stage topology has no peers")
        peer = topology.stage(index - 1 if index else len(topology.stages) - 1)
        return cls([peer.host], source=f"the topology: stage {peer.index}'s host")

    def describe(self) -> str:
        return "any address" if self.any else ", ".join(self.entries)

    async def allows(self, address: str) -> bool:
        """Whether a peer at `address` (an IP address as getpeername gives it) may connect."""
        if self.any:
            return True
        ip = _ip(address)
        if ip is None:
            return False
        if any(ip in net for net in self._networks):
            return True
        for name in self._names:
            if any(ip in net for net in await self._resolve(name)):
                return True
        return False

    async def _resolve(self, name: str) -> list:
        now = trio.current_time()
        cached = self._resolved.get(name)
        if cached is not None and now - cached[0] < RESOLVE_TTL_S:
            return cached[1]
        try:
            with trio.fail_after(5):
                infos = await trio.socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, trio.TooSlowError) as exc:
            log.warning("upstream allow-list: cannot resolve %s (%s); it allows nothing until it resolves",
                        name, exc or "timed out")
            nets = cached[1] if cached is not None else []  # a resolver hiccup keeps what we knew
            self._resolved[name] = (now - RESOLVE_TTL_S + 10.0, nets)  # and is retried in 10 s, not per peer
            return nets
        nets = []
        for info in infos:
            ip = _ip(info[4][0])
            if ip is not None:
                nets.extend(_widen(ipaddress.ip_network(ip)))
        self._resolved[name] = (now, nets)
        return nets
