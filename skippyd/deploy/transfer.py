"""What ``skippyctl deploy`` and a supervising head (skippyd/deploy/supervisor.py) both do to put a model on
hosts: send a slice over a host's control channel, cut the calibration slice every host times, and cut a
plan's stage files once per ranges (kept, so that the same plan again costs nothing).

A slice goes as ``slice_offer`` (the host says what it holds), ``slice_chunk``
messages from where an interrupted transfer stopped, and ``slice_commit``
(the host checks the sha256); one that arrives damaged is sent again, three
times at most.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs

from skippyd.control import messages as m
from skippyd.control.client import ControlClient, ControlError
from skippyd.runtime.slicing import split_model, write_middle_slice
from skippyd.topology import Topology, parse_address

CHUNK = 512 << 10  # bytes per slice_chunk (base64 in JSON: under the websocket's 1 MiB per message)
CALIBRATION_LAYERS = 4  # the calibration slice: this many of the model's middle layers
ATTEMPTS = 3  # a slice that arrives damaged goes again, this many times in all
COMMIT_TIMEOUT_S = 60.0  # the host hashes the whole slice before it answers


@attrs.define
class Sent:
    """What one slice's transfer to one host did."""

    size: int
    held: bool = False  # the host held it already: nothing sent
    resumed_from: int = 0  # bytes an earlier, interrupted transfer had left there
    sent: int = 0
    resent: int = 0  # times it arrived damaged and went again


class DamagedThrice(Exception):
    """The slice arrived damaged at every attempt."""


async def send_slice(link: ControlClient, path: Path, sha256: str, *,
                     update: Callable[[int, int], None] = lambda done, total: None,
                     pace: Callable[[int], Awaitable[None]] | None = None,
                     on_start: Callable[[], None] | None = None) -> Sent:
    """Send the file unless the host holds it, resuming where an interrupted transfer stopped. `update(done,
    total)` follows the bytes the host has; `pace(n)` waits before each chunk of n bytes (a rate limit);
    `on_start` is called once, before the first chunk goes (not when the host holds the file). Raises
    DamagedThrice, or the link's ControlError."""
    size = path.stat().st_size
    for attempt in range(ATTEMPTS):
        offer = await link.call(m.SliceOffer(id=link.new_id(), sha256=sha256, size=size))
        if offer["held"]:
            update(size, size)
            return Sent(size, held=True, resent=attempt)
        done = offer["received"]
        result = Sent(size, resumed_from=done, resent=attempt)
        update(done, size)
        if on_start is not None and done < size:
            on_start()
            on_start = None
        with open(path, "rb") as f:
            f.seek(done)
            while done < size:
                block = f.read(CHUNK)
                if pace is not None:
                    await pace(len(block))
                reply = await link.call(m.SliceChunk(id=link.new_id(), sha256=sha256, offset=done,
                                                     data=base64.b64encode(block).decode("ascii")))
                done = reply["received"]
                result.sent += len(block)
                update(done, size)
        try:
            await link.call(m.SliceCommit(id=link.new_id(), sha256=sha256, size=size), COMMIT_TIMEOUT_S)
        except ControlError as exc:
            if exc.code != "corrupt":
                raise
            update(0, size)  # the host deleted what arrived: all of it goes again
            continue
        return result
    raise DamagedThrice(f"{path.name} arrived damaged {ATTEMPTS} times: check the link and the host's disk")


def calibration_range(n_layer: int) -> tuple[int, int]:
    """The layers every host times: a few middle ones (empty when the model has too few)."""
    start = 1
    return start, min(n_layer - 1, start + CALIBRATION_LAYERS)


def calibration_slice(model: Path, n_layer: int, folder: Path) -> tuple[Path, str]:
    """The calibration slice of `model` and its sha256, cut into `folder` once (kept there with its sha256)."""
    start, end = calibration_range(n_layer)
    path = folder / f"calibration-{start}-{end}.gguf"
    record = path.with_suffix(".sha256")
    if path.exists() and record.exists():
        return path, record.read_text().strip()
    folder.mkdir(parents=True, exist_ok=True)
    sha = write_middle_slice(model, start, end, path)
    record.write_text(sha + "\n")
    return path, sha


def cut_slices(model: Path, ranges: Sequence[tuple[int, int]], folder: Path, addresses: Sequence[str]) -> Topology:
    """The stage files of `ranges`, cut from `model` into folder/RANGES once (a later call with the same ranges
    finds them there), in a topology whose stages listen at `addresses`."""
    where = folder / "_".join(f"{a}-{b}" for a, b in ranges)
    try:
        cached = Topology.load(where / "topology.toml")
    except (OSError, ValueError):  # (TopologyError is one)
        cached = None
    if cached is not None and cached.ranges == list(ranges) and all(s.file.exists() for s in cached.stages):
        stages = [attrs.evolve(s, host=host, port=port)
                  for s, (host, port) in zip(cached.stages, map(parse_address, addresses))]
        return attrs.evolve(cached, stages=stages)
    return split_model(model, list(ranges), where, hosts=list(addresses))


def wire_topology(topology: Topology) -> str:
    """The topology the hosts get: stage files (and the head's projector) named by their sha256, as the hosts
    keep them."""
    def named(s):
        mmproj = None if s.mmproj is None else Path(f"{s.mmproj_sha256}.gguf")
        return attrs.evolve(s, file=Path(f"{s.sha256}.gguf"), mmproj=mmproj)

    return attrs.evolve(topology, stages=[named(s) for s in topology.stages]).to_toml()
