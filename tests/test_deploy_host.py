"""A host's side of a deployment: the slice store, what it reports, and a waiting daemon's answers to bad
requests (real daemon processes on loopback, for those)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio

from skippyctl.client import ControlError, call_once, open_control
from skippyd.control import messages as m
from skippyd.control.token import load_or_create_token
from skippyd.deploy.resources import cgroup_memory_room, memory_for_skippy
from skippyd.deploy.slices import CHUNK_MAX, SliceStore, SliceStoreError, default_slices_dir
from tests.procs import REPO, Daemon, free_ports

DATA = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(DATA).hexdigest()


def _code(exc_info) -> str:
    return exc_info.value.code


def _write(store: SliceStore, data: bytes, start: int = 0) -> None:
    """`data` from byte `start` on, in chunks as a sender sends them."""
    for at in range(start, len(data), 512 << 10):
        store.write(SHA, at, data[at:min(at + (512 << 10), len(data))])


# ---------------------------------------------------------------- the store
def test_a_slice_arrives_in_order_is_checked_and_kept(tmp_path):
    store = SliceStore(tmp_path / "slices")
    offer = store.offer(SHA, len(DATA))
    assert (offer.held, offer.received) == (False, 0)
    assert store.write(SHA, 0, DATA[:300_000]) == 300_000
    with pytest.raises(SliceStoreError) as out_of_order:
        store.write(SHA, 200_000, DATA[200_000:400_000])
    assert _code(out_of_order) == "conflict" and "must come in order" in str(out_of_order.value)
    with pytest.raises(SliceStoreError) as early:
        store.commit(SHA, len(DATA))
    assert _code(early) == "conflict" and "300000 of 1048576 bytes" in str(early.value)
    # an interrupted transfer: the next offer says where to go on
    assert store.offer(SHA, len(DATA)).received == 300_000
    _write(store, DATA, 300_000)
    store.commit(SHA, len(DATA))
    assert store.path(SHA).read_bytes() == DATA and not list(store.dir.glob("*.part"))
    assert store.offer(SHA, len(DATA)).held and store.held() == [{"sha256": SHA, "size": len(DATA)}]


def test_a_damaged_slice_is_deleted_whether_it_arrived_so_or_was_damaged_since(tmp_path):
    store = SliceStore(tmp_path)
    store.offer(SHA, len(DATA))
    _write(store, DATA[:-1] + b"\0")
    with pytest.raises(SliceStoreError) as damaged:
        store.commit(SHA, len(DATA))
    assert _code(damaged) == "corrupt" and not list(tmp_path.iterdir())
    _write(store, DATA)
    store.commit(SHA, len(DATA))
    with open(store.path(SHA), "r+b") as f:  # on disk, later
        f.seek(1000)
        f.write(b"\xff")
    offer = store.offer(SHA, len(DATA))
    assert (offer.held, offer.received, offer.replaced) == (False, 0, True)
    assert not store.path(SHA).exists()


def test_bad_requests_are_refused_with_their_reason(tmp_path):
    store = SliceStore(tmp_path)
    with pytest.raises(SliceStoreError, match="not a sha256"):
        store.offer("../../etc/passwd", 10)
    with pytest.raises(SliceStoreError) as not_offered:
        store.write(SHA, 10, b"x")
    assert _code(not_offered) == "not_found"
    with pytest.raises(SliceStoreError, match="at most"):
        store.write(SHA, 0, bytes(CHUNK_MAX + 1))
    with pytest.raises(SliceStoreError) as no_room:
        store.offer(SHA, 1 << 62)
    assert _code(no_room) == "unavailable" and "not enough disk space" in str(no_room.value)
    # a part longer than the slice it claims to be is not a prefix of it: started over
    _write(store, DATA)
    assert store.offer(SHA, 100).received == 0


def test_where_slices_are_kept_by_default():
    assert default_slices_dir({"STATE_DIRECTORY": "/var/lib/skippy:/x"}) == Path("/var/lib/skippy/slices")
    assert default_slices_dir({"XDG_STATE_HOME": "/s", "HOME": "/h"}) == Path("/s/skippy/slices")


def test_memory_for_skippy_is_the_least_of_the_host_its_cgroup_and_the_limit(tmp_path):
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "memory.max").write_text(f"{500 << 20}\n")
    (root / "a" / "memory.current").write_text(f"{100 << 20}\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_memory_room(str(proc), str(root)) == 400 << 20
    proc.write_text("4:memory:/a\n")  # no unified hierarchy line
    assert cgroup_memory_room(str(proc), str(root)) is None
    assert 0 < memory_for_skippy(64) <= 64 << 20


# ---------------------------------------------------------------- a waiting daemon
@pytest.fixture
def waiting(tmp_path):
    d = Daemon(["--slices-dir", str(tmp_path / "slices"), "--lanes", "1", "--ctx", "256"], tmp_path, "waiting")
    d.wait_ready()
    yield d
    assert d.stop() == 0, d.log()


@pytest.mark.slow
def test_the_service_on_a_fresh_host_waits_with_its_slices_in_its_state_directory(tmp_path):
    """skippyd.service's command line on a host with no skippyd.toml: the defaults, waiting."""
    (tmp_path / "etc").mkdir()
    d = Daemon([], tmp_path, "fresh", env={"CONFIGURATION_DIRECTORY": str(tmp_path / "etc"),
                                           "STATE_DIRECTORY": str(tmp_path / "state")}, as_service=True)
    try:
        d.wait_ready()
        status = d.status()
        assert status["role"] == "waiting for a deployment" and status["config"] is None
        assert status["deployment"]["slices_dir"] == str(tmp_path / "state" / "slices")
    finally:
        assert d.stop() == 0, d.log()


def _call(d: Daemon, make):
    return call_once(d.url, d.token_file, make)


@pytest.mark.slow
def test_a_waiting_daemon_reports_its_host_and_refuses_bad_deployments_without_going_down(waiting, tmp_path):
    host = _call(waiting, lambda i: m.Host(id=i))
    assert host["accepts_stages"] and host["assigned"] is None and host["cores"] >= 1
    assert host["memory_bytes"] > 0 and host["disk_free_bytes"] > 0 and host["features"]
    assert host["ctx"] == 256 and host["lanes"] == 1 and host["slices_dir"] == str(tmp_path / "slices")
    # this build has no GPU backend: the CPU alone, with its memory, and no layers offloaded
    assert host["gpu_backend"] == "none" and host["gpu_layers"] == 0
    assert [d["kind"] for d in host["devices"]] == ["cpu"] and host["devices"][0]["memory_total"] > 0

    with pytest.raises(ControlError, match="not base64"):
        _call(waiting, lambda i: m.SliceChunk(id=i, sha256=SHA, offset=0, data="@@@"))
    with pytest.raises(ControlError, match="must be a sha256"), attrs.validators.disabled():  # the daemon checks
        _call(waiting, lambda i: m.SliceOffer(id=i, sha256="../x", size=1))
    with pytest.raises(ControlError, match="is not held here"):
        _call(waiting, lambda i: m.Calibrate(id=i, sha256=SHA))
    with pytest.raises(ControlError, match="invalid TOML"):
        _call(waiting, lambda i: m.StageAssign(id=i, topology="[[stages", stage=0))

    # a slice sent, then a topology whose stage cannot start (its port is taken): refused, the daemon waits on
    _call(waiting, lambda i: m.SliceOffer(id=i, sha256=SHA, size=len(DATA)))
    for at in range(0, len(DATA), 512 << 10):
        block = base64.b64encode(DATA[at:at + (512 << 10)]).decode()
        _call(waiting, lambda i, at=at, block=block: m.SliceChunk(id=i, sha256=SHA, offset=at, data=block))
    assert _call(waiting, lambda i: m.SliceCommit(id=i, sha256=SHA, size=len(DATA))) == {"held": True}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        topology = _one_stage_topology(SHA, port)
        with pytest.raises(ControlError, match="stage 0 did not start") as failed:
            _call(waiting, lambda i: m.StageAssign(id=i, topology=topology, stage=0))
    assert failed.value.code == "failed"
    with pytest.raises(ControlError, match="no stage 3"):
        _call(waiting, lambda i: m.StageAssign(id=i, topology=topology, stage=3))
    status = waiting.status()
    assert status["role"] == "waiting for a deployment" and status["deployment"]["assigned"] is None
    assert _call(waiting, lambda i: m.StageRelease(id=i)) == {"released": None}


def _one_stage_topology(sha: str, port: int) -> str:
    return (f'version = 1\nmodel_name = "m"\nsource_sha256 = "{"0" * 64}"\narchitecture = "llama"\n'
            f'n_layer = 30\nn_embd = 576\nn_vocab = 49152\n\n[[stages]]\nindex = 0\nfile = "{sha}.gguf"\n'
            f'sha256 = "{sha}"\nlayer_start = 0\nlayer_end = 30\nhost = "127.0.0.1"\nport = {port}\n'
            f'output = "logits"\n')


@pytest.mark.slow
def test_a_daemon_given_a_model_takes_no_assignment(default_model_path, tmp_path):
    d = Daemon(["--model", str(default_model_path), "--lanes", "1", "--ctx", "256",
                "--slices-dir", str(tmp_path / "slices")], tmp_path, "fixed")
    try:
        d.wait_ready()
        assert not _call(d, lambda i: m.Host(id=i))["accepts_stages"]
        with pytest.raises(ControlError, match="runs the stages its command line"):
            _call(d, lambda i: m.StageAssign(id=i, topology=_one_stage_topology(SHA, 1), stage=0))
        assert d.status()["deployment"] is None
    finally:
        assert d.stop() == 0, d.log()


def test_nothing_to_run_and_no_control_channel_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "skippyd.daemon", "--no-control"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "nothing to run" in proc.stderr and "Traceback" not in proc.stderr



def _two_free_ports() -> int:
    """A port P with P + 1 free too (stage K listens on --stage-port + K)."""
    for _ in range(50):
        port = free_ports(1)[0]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two consecutive free ports")


def _skippyctl_proc(tmp_path: Path, token: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SKIPPY_CACHE_DIR": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state")}
    return subprocess.run([sys.executable, "-m", "skippyctl.app", "--token-file", str(token), *args, "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _skippyctl(tmp_path: Path, token: Path, *args: str) -> dict:
    proc = _skippyctl_proc(tmp_path, token, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


async def _undeploy_mid_stream(head: Daemon, tmp_path: Path) -> m.Result | m.Error | None:
    """A generation streaming from `head`, undeploy run after its fifth piece; how it ended."""
    pieces, end = 0, None

    async def stream():
        nonlocal pieces, end
        async with open_control(head.url, head.token_file) as client:
            async for reply in client.replies(m.Generate(id=client.new_id(), prompt="Count: 1, 2, 3,", raw=True,
                                                         max_tokens=400)):
                if isinstance(reply, m.Piece):
                    pieces += 1
                else:
                    end = reply

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        with trio.fail_after(60):
            while pieces < 5:
                await trio.sleep(0.02)
        await trio.to_thread.run_sync(lambda: _skippyctl(tmp_path, tmp_path / "seed.token", "undeploy"))
    return end


@pytest.mark.slow
def test_undeploy_mid_generation_a_failed_deploy_and_a_new_one_on_the_same_daemons(default_model_path, tmp_path):
    """Two waiting daemons on loopback; host 0 cannot serve its OpenAI endpoint at first (the port is taken).

    A generation streams through a deployment headed by host 1 when undeploy releases it: the client gets the
    reason, every host waits again. A deployment the other way round fails when host 0's head cannot start,
    after host 1's stage did: the deploy names host 0, and host 1's stage is released, not left waiting for a
    head. With the port free, the same deployment runs (the slices sent the first time)."""
    token = load_or_create_token(tmp_path / "seed.token")
    for k in range(2):
        (tmp_path / f"host{k}.token").write_text(token + "\n")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    openai = ["--openai", f"127.0.0.1:{taken.getsockname()[1]}"]
    daemons = [Daemon(["--slices-dir", str(tmp_path / f"slices{k}"), "--lanes", "2", "--ctx", "512",
                       *(openai if k == 0 else [])], tmp_path, f"host{k}") for k in range(2)]
    names = [f"127.0.0.1:{d.control_port}" for d in daemons]
    seed = tmp_path / "seed.token"
    try:
        for d in daemons:
            d.wait_ready()
        deployed = _skippyctl(tmp_path, seed, "deploy", str(default_model_path), "--hosts", f"{names[1]},{names[0]}",
                              "--ranges", "0:15,15:30", "--stage-port", str(_two_free_ports()))
        assert [s["host"] for s in deployed["plan"]["stages"]] == [names[1], names[0]]
        # what a running stage holds counts as the host's to give to the next deployment
        assert all(_call(d, lambda i: m.Host(id=i))["memory_held_bytes"] > 0 for d in daemons)
        end = trio.run(_undeploy_mid_stream, daemons[1], tmp_path)
        # the generation's result: cancelled, the reason with it
        assert isinstance(end, m.Result) and end.result["finish_reason"] == "cancelled", end
        assert "the deployment running this generation was released" in end.result["error"]
        for d in daemons:
            status = d.status()
            assert status["role"] == "waiting for a deployment" and status["load"]["live_generations"] == 0
            assert status["stages"] == [] and status["head"] is None, status
            assert _call(d, lambda i: m.Host(id=i))["memory_held_bytes"] == 0

        args = ["deploy", str(default_model_path), "--hosts", ",".join(names), "--ranges", "0:15,15:30",
                "--stage-port", str(_two_free_ports())]
        proc = _skippyctl_proc(tmp_path, seed, *args)
        assert proc.returncode == 1 and names[0] in proc.stderr and "stage 0 did not start" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        for d in daemons:
            assert d.status()["deployment"]["assigned"] is None
        assert daemons[1].log().count("deploy: releasing stage 1") == 1

        taken.close()
        again = _skippyctl(tmp_path, seed, *args)
        assert again["bytes_sent"] == 0, again["transfers"]  # the failed attempt left them there
        assert len(call_once(daemons[0].url, daemons[0].token_file, lambda i: m.Generate(
            id=i, prompt="Hello", raw=True, max_tokens=4))["tokens"]) == 4
    finally:
        taken.close()
        for d in daemons:
            assert d.stop() == 0, d.log()


@pytest.mark.slow
def test_clients_that_go_before_their_refusal_or_handshake_leave_the_daemon_up(waiting):
    """Upgrade requests (wrong token, right token) whose client closes at once, before the answer: the daemon
    answers the next client as before."""
    token = waiting.token_file.read_text().strip()
    for bearer in ("wrong", token) * 20:
        with socket.create_connection((waiting.control_host, waiting.control_port)) as s:
            s.sendall(f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                      f"Authorization: Bearer {bearer}\r\n\r\n".encode())
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
    assert waiting.status()["role"] == "waiting for a deployment"
    assert waiting.proc.poll() is None
