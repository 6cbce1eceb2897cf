"""Machines: a topology's hosts counted by address, so two names of one machine count once."""

from __future__ import annotations

import socket

from skippyd.hosts import THIS_MACHINE, Machines, is_local_address

NAMES = {
    "gpu-box": ["10.0.0.5"],
    "gpu-box.lan": ["10.0.0.5", "fd00::5"],
    "other": ["10.0.0.6"],
    "me": ["192.0.2.200"],  # this machine's LAN address, as the fake is_local says
    "v6only": ["fd00::7"],
}


def fake_resolve(host: str) -> list[str]:
    if host in NAMES:
        return NAMES[host]
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return [host]
    except OSError:
        raise socket.gaierror(f"unknown host {host}") from None


def fake_local(address: str) -> bool:
    return address in ("127.0.0.1", "::1", "0.0.0.0", "192.0.2.200")


def machines() -> Machines:
    return Machines(resolve=fake_resolve, is_local=fake_local)


def test_two_names_of_one_machine_count_once():
    m = machines()
    assert m.of("gpu-box") == m.of("gpu-box.lan") == m.of("10.0.0.5") != m.of("other")
    assert m.count(["gpu-box", "gpu-box.lan", "10.0.0.5"]) == 1
    assert m.count(["gpu-box", "other"]) == 2


def test_a_topologys_hosts_as_written():
    """decode_groups = 0 keeps one group per machine: every loopback address is this one machine, and a
    name is one machine however it is capitalised."""
    m = machines()
    assert m.count(["127.0.0.1", "::1"]) == 1
    assert m.count(["10.0.0.1", "HostB"]) == 2
    assert m.count(["hostb", "hostb"]) == 1 and m.of("HostB") == m.of("hostb")


def test_loopback_and_this_machines_addresses_are_this_machine():
    m = machines()
    for host in ("127.0.0.1", "localhost", "LOCALHOST", "::1", "[::1]", "me", "192.0.2.200"):
        assert m.of(host) == THIS_MACHINE, host
    assert m.count(["127.0.0.1", "localhost", "me", "other"]) == 2


def test_an_unresolvable_name_is_its_own_machine():
    m = machines()
    assert m.of("nowhere.invalid") == "nowhere.invalid"
    assert m.count(["nowhere.invalid", "elsewhere.invalid", "other"]) == 3
    assert m.of("v6only") == "fd00::7"


def test_each_host_is_resolved_once():
    asked = []

    def counting(host):
        asked.append(host)
        return fake_resolve(host)

    m = Machines(resolve=counting, is_local=fake_local)
    for _ in range(3):
        m.count(["gpu-box", "other"])
    assert sorted(asked) == ["gpu-box", "other"]


def test_is_local_address_binds_for_real():
    assert is_local_address("127.0.0.1") and is_local_address("0.0.0.0")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never this machine's
    assert not is_local_address("not an address")


def test_this_machines_names_resolve_to_it():
    assert Machines().of("localhost") == THIS_MACHINE
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return  # a host name this machine cannot resolve counts as itself (the test above covers that)
    assert Machines().of(socket.gethostname()) == THIS_MACHINE
