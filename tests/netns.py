"""Hosts of their own for the tests: network namespaces joined by a veth pair, and faults on that link.

Each host is a network namespace with its own stack. The hosts share one data
network (10.77.0.0/24: host k is 10.77.0.<k+1>), the only path between them: a
veth pair for two hosts, a bridge in a namespace of its own (a switch) for
more. A test cuts a host's link (``link_down``), makes packets between two
hosts lose their way one way (``drop``: an nftables rule on the receiving
host's input, so the packets leave their sender and never arrive) or both
(``partition``: two hosts that no longer hear each other, each still hearing
the others), or slows what reaches a host (``limit_rate``: a token bucket on
its port of the switch; needs ``tc``). Each host also has a management link
to the test's own namespace (a veth pair on a /30 of 10.78.0.0/16) that no
fault touches: the daemons' control channels listen there, so a test can
ask a stage for its sessions while the data link is down.

Needs root (or CAP_NET_ADMIN) and ``ip``; ``drop`` needs ``nft`` (Debian
package nftables; scripts/test installs it). :func:`unavailable` says why
not, for a skip. A daemon runs in a host with ``ip netns exec NAME``: see
:meth:`Host.exec_prefix`, for tests.procs.Daemon's ``prefix``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest

DATA_NET = "10.77.0"  # the data link's /24: host k is DATA_NET.<k+1>


class NetnsError(RuntimeError):
    pass


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable(need_nft: bool = False) -> str | None:
    """Why namespaces cannot be used here (None: they can): for a skip's reason."""
    if shutil.which("ip") is None:
        return "no `ip` command (Debian package iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN): run the tests as root"
    probe = f"skprobe{uuid.uuid4().hex[:6]}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    try:
        if need_nft:
            if shutil.which("nft") is None:
                return "no `nft` command (Debian package nftables; scripts/test installs it as root)"
            nft = _run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe", check=False)
            if nft.returncode != 0:
                return f"nftables does not work in a network namespace here: {nft.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def network_for_test(n: int = 2) -> Iterator[Network]:
    """A Network of ``n`` hosts for as long as the block runs, or the test skipped with why there can be none."""
    why = unavailable()
    if why:
        pytest.skip(why)
    with Network(n) as network:
        yield network


def _free_mgmt_base() -> int:
    """The third octet of a 10.78.X.0/24 no interface of ours uses yet."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    for _ in range(200):
        x = random.randrange(0, 256)
        if f" 10.78.{x}." not in used:
            return x
    raise NetnsError("no free 10.78.X.0/24 for the management links")


class Host:
    """One namespace: its name, its address on the data link and on its management link."""

    def __init__(self, name: str, index: int, data_dev: str, mgmt_dev: str, mgmt_host: str, mgmt_peer: str):
        self.name = name
        self.index = index
        self.address = f"{DATA_NET}.{index + 1}"  # on the data link
        self.data_dev = data_dev  # its end of the data link
        self.mgmt_dev = mgmt_dev  # the test's end of its management link (in the test's namespace)
        self.control_host = mgmt_host  # its address on the management link: where its control channel listens
        self.mgmt_peer = mgmt_peer

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*self.exec_prefix(), *args, check=check)


class Network:
    """`n` hosts on one data network; :meth:`close` (or the context manager) removes everything it made."""

    def __init__(self, n: int = 2):
        if n < 2:
            raise ValueError("a network needs two hosts at least")
        self.tag = uuid.uuid4().hex[:5]
        self.hosts: list[Host] = []
        self.switch: str | None = None  # the bridge's namespace (three hosts or more)
        self._dropping: set[int] = set()
        try:
            self._build(n)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int) -> None:
        base = _free_mgmt_base()
        data = [f"skd{self.tag}{k}" for k in range(n)]
        for k in range(n):
            name = f"sk{self.tag}h{k}"
            _run("ip", "netns", "add", name)
            net = ipaddress.ip_network(f"10.78.{base}.{4 * k}/30")
            ours, theirs = (str(a) for a in list(net.hosts())[:2])
            mgmt = f"skm{self.tag}{k}"
            host = Host(name, k, data[k], mgmt, theirs, ours)
            self.hosts.append(host)
            _run("ip", "link", "add", mgmt, "type", "veth", "peer", "name", f"skn{self.tag}{k}")
            _run("ip", "link", "set", f"skn{self.tag}{k}", "netns", name)
            _run("ip", "addr", "add", f"{ours}/30", "dev", mgmt)
            _run("ip", "link", "set", mgmt, "up")
            host.run("ip", "addr", "add", f"{theirs}/30", "dev", f"skn{self.tag}{k}")
            host.run("ip", "link", "set", f"skn{self.tag}{k}", "up")
            host.run("ip", "link", "set", "lo", "up")
        if n == 2:
            a, b = self.hosts
            _run("ip", "link", "add", a.data_dev, "type", "veth", "peer", "name", b.data_dev)
        else:  # each host's data link goes to a port of one bridge, in a namespace of its own
            self.switch = f"sk{self.tag}sw"
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for k, host in enumerate(self.hosts):
                port = f"skp{self.tag}{k}"
                _run("ip", "link", "add", host.data_dev, "type", "veth", "peer", "name", port)
                _run("ip", "link", "set", port, "netns", self.switch)
                _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.switch, "link", "set", port, "up")
        for host in self.hosts:
            _run("ip", "link", "set", host.data_dev, "netns", host.name)
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", host.data_dev)
            host.run("ip", "link", "set", host.data_dev, "up")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the namespaces (their interfaces go with them, and the management links' other ends)."""
        for host in self.hosts:
            _run("ip", "netns", "del", host.name, check=False)
            _run("ip", "link", "del", host.mgmt_dev, check=False)
        if self.switch is not None:
            _run("ip", "netns", "del", self.switch, check=False)
            self.switch = None
        self.hosts = []

    # ---------------------------------------------------------------- faults
    def link_down(self, k: int = 1) -> None:
        """Take host k's end of its data link down: nothing passes either way (no FIN, no RST)."""
        h = self.hosts[k]
        h.run("ip", "link", "set", h.data_dev, "down")

    def link_up(self, k: int = 1) -> None:
        h = self.hosts[k]
        h.run("ip", "link", "set", h.data_dev, "up")

    def arm(self, dst: int) -> None:
        """Make host `dst`'s (empty) rule chain now, so that :meth:`drop` is a single quick command."""
        h = self.hosts[dst]
        if dst not in self._dropping:
            h.run("nft", "add", "table", "inet", "skfault")
            h.run("nft", "add", "chain", "inet", "skfault", "input",
                  "{ type filter hook input priority 0 ; policy accept ; }")
            self._dropping.add(dst)

    def drop(self, src: int, dst: int) -> None:
        """Lose every packet from host `src` to host `dst` (the other way still works): dropped on arrival
        at `dst`, so `src` sends them as usual and hears nothing back for them."""
        self.arm(dst)
        self.hosts[dst].run("nft", "add", "rule", "inet", "skfault", "input", "ip", "saddr",
                            self.hosts[src].address, "drop")

    def partition(self, a: int, b: int) -> None:
        """Hosts `a` and `b` no longer hear each other (every packet between them lost, both ways); each still
        hears every other host."""
        self.arm(a)
        self.arm(b)
        self.drop(a, b)
        self.drop(b, a)

    def limit_rate(self, k: int, mbit: float) -> None:
        """Packets to host k leave the switch at `mbit` Mbit/s at most (a token bucket on its switch port):
        a slow link into one host, the others' untouched. Three hosts or more (a switch)."""
        if self.switch is None:
            raise NetnsError("a rate limit needs the switch of three hosts or more")
        _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", f"skp{self.tag}{k}", "root",
             "tbf", "rate", f"{mbit}mbit", "burst", "32kbit", "latency", "1s")

    def unlimit_rate(self, k: int) -> None:
        if self.switch is not None:
            _run("ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", f"skp{self.tag}{k}", "root",
                 check=False)

    def heal(self) -> None:
        """Undo every fault: links up, drop rules and rate limits gone."""
        for k in range(len(self.hosts)):
            self.unlimit_rate(k)
        for k in sorted(self._dropping):
            self.hosts[k].run("nft", "delete", "table", "inet", "skfault", check=False)
        self._dropping.clear()
        for host in self.hosts:
            host.run("ip", "link", "set", host.data_dev, "up", check=False)
