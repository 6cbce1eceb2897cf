"""The floor under a stage's event loop CPU per decode step on this machine: a bare trio server that does
nothing but what every stage must, per step: wake on its socket, read one frame of a hidden state, send one
small reply, and go back to waiting while the rest of the pipeline computes.

    .venv/bin/python bench/wake_floor.py [--steps 300] [--gap-ms 0,5,15] [--frame-bytes 2304]

A driver process sends a frame, waits for the reply, then stays away ``--gap-ms`` (a busy loop, as a
stage computing elsewhere on the host keeps a core busy) before the next; the server (its own process)
measures its thread's CPU per step. Printed per gap: median and spread over 3 runs of the server's CPU per
step, in ms, for the trio server and for the same loop on a blocking socket without an event loop. The idle
gap is what matters on a VM: a thread woken after milliseconds idle finds its caches
cold and pays for the wake-up itself, so the same few hundred instructions cost several times what they
cost back to back. Compare with the suite's "event loop CPU ms / step" rows (bench/bench_pipeline.py) and
bench/ab_trees.py, whose stages see gaps of 5-15 ms per step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import struct
import time

import trio

REPLY = b"\x00" * 48  # about an Ack with its stats


async def _serve(port_out, steps: int, frame_bytes: int, result) -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port_out.send(listener.getsockname()[1])
    sock, _ = await listener.accept()
    stream = trio.SocketStream(sock)
    buf = bytearray()
    cpu = []
    mark = time.thread_time()
    for _ in range(steps):  # a step: from the previous reply sent to this one (the wait, the wake, the read)
        while len(buf) < frame_bytes:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        del buf[:frame_bytes]
        await stream.send_all(REPLY)
        now = time.thread_time()
        cpu.append(now - mark)
        mark = now
    result.send(cpu[1:])  # the first step includes the accept


def _server(port_out, steps, frame_bytes, result) -> None:
    trio.run(_serve, port_out, steps, frame_bytes, result)


def _plain_server(port_out, steps, frame_bytes, result) -> None:
    """The same with a blocking socket and no event loop: what the wake-up costs Python alone."""
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    cpu = []
    mark = time.thread_time()
    for _ in range(steps):
        while len(buf) < frame_bytes:
            data = sock.recv(65536)
            if not data:
                return
            buf += data
        del buf[:frame_bytes]
        sock.sendall(REPLY)
        now = time.thread_time()
        cpu.append(now - mark)
        mark = now
    result.send(cpu[1:])


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _drive(port: int, steps: int, frame_bytes: int, gap_s: float) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    frame = struct.pack("<I", frame_bytes) + b"\x01" * (frame_bytes - 4)
    for _ in range(steps):
        await stream.send_all(frame)
        got = 0
        while got < len(REPLY):
            got += len(await stream.receive_some(65536))
        _busy(gap_s)
    await stream.aclose()


def measure(steps: int, frame_bytes: int, gap_s: float, server=_server) -> float:
    """The server's CPU per step (ms, median over the steps)."""
    port_recv, port_send = multiprocessing.Pipe(duplex=False)
    res_recv, res_send = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.Process(target=server, args=(port_send, steps, frame_bytes, res_send))
    proc.start()
    try:
        port = port_recv.recv()
        trio.run(_drive, port, steps, frame_bytes, gap_s)
        cpu = res_recv.recv()
    finally:
        proc.join(10)
    return statistics.median(cpu) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--gap-ms", default="0,5,15", help="comma-separated gaps between steps")
    ap.add_argument("--frame-bytes", type=int, default=2304, help="a hidden state (default model: 576 x 4)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"bare trio server, one {args.frame_bytes}-byte frame in and one {len(REPLY)}-byte reply out per step")
    for gap in (float(g) for g in args.gap_ms.split(",")):
        for name, server in (("trio", _server), ("blocking socket", _plain_server)):
            values = [measure(args.steps, args.frame_bytes, gap / 1e3, server) for _ in range(args.runs)]
            print(f"  gap {gap:5.1f} ms, {name:15}: server CPU per step {statistics.median(values):.3f} ms "
                  f"({min(values):.3f}-{max(values):.3f}) over {args.runs} runs")


if __name__ == "__main__":
    main()
