"""The prefix cache's disk tier on real pipelines: a clean stop writes what every stage holds, a restart
restores it (the same tokens as the same restore before the restart, and the cold reply's up to a near-tie),
and a damaged file makes a cold, correct turn with one warning line.

Each test runs a 2-stage pipeline of the default model, every stage its own process, with the cache and its
disk tier on, in a directory the test owns.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from skippyctl.app import app
from skippyctl.client import open_control
from skippyd.control import messages as m
from skippyd.stage.prefix_disk import SUFFIX
from skippyd.topology import Topology
from tests.procs import Pipeline, split_for_test

pytestmark = pytest.mark.slow  # real daemon processes

SYSTEM = ("You are the assistant of a harbour office. You answer questions about ships, tides, lighthouses and "
          "the weather on the coast. You are precise, you give numbers where you have them, and you say when "
          "you do not know something. ") * 3
NEAR_TIE = 0.25  # as tests/test_speculative.py: a restored prefix rounds differently from a whole prefill


def start(topology, tmp_path, workdir=None) -> Pipeline:
    return Pipeline(topology, workdir or tmp_path, extra=["--lanes", "2", "--ctx", "2048", "--prefix-cache-mb",
                                                          "512", "--prefix-cache-dir", str(tmp_path / "pc")]).start()


async def call(pipe: Pipeline, make) -> object:
    async with open_control(pipe.head.url, pipe.head.token_file) as client:
        return await client.call(make(client.new_id()))


def ctl(daemon, *args: str):
    return CliRunner().invoke(app, ["--url", daemon.url, "--token-file", str(daemon.token_file), *args])


def ctl_json(daemon, *args: str):
    result = ctl(daemon, *args, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return json.loads(result.stdout)


def stage_files(tmp_path, k: int) -> list:
    return sorted((tmp_path / "pc" / f"stage-{k}").glob(f"*{SUFFIX}"))


def assert_same_or_near_tie(got: dict, want: dict) -> None:
    i = next((i for i, (a, b) in enumerate(zip(got["tokens"], want["tokens"])) if a != b), None)
    if i is None:
        assert len(got["tokens"]) == len(want["tokens"]), (got, want)
        return
    top = want["logprobs"][i]["top"]
    margin = top[0][1] - top[1][1] if len(top) > 1 else math.inf
    assert margin <= NEAR_TIE, f"the replies part at token {i}, where the best two are {margin:.4f} apart"


@pytest.fixture
def conversation(default_model_path, tmp_path):
    """A follow-up turn, its cold reply (with logprobs) and its reply restored from memory; the pipeline was
    stopped cleanly after them."""
    topology = tmp_path / "topology.toml"
    split_for_test(default_model_path, 2, tmp_path)
    pipe = start(topology, tmp_path)
    try:
        turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is the next high tide?"}]
        first = await_(pipe.generate(messages=turn, max_tokens=24))
        follow = [*turn, {"role": "assistant", "content": first["text"]},
                  {"role": "user", "content": "Which ships are due this week?"}]
        await_(call(pipe, lambda i: m.CacheClear(id=i, disk=True)))
        cold = await_(pipe.generate(messages=follow, max_tokens=24, logprobs=2))
        assert cold["usage"]["cached_tokens"] == 0
        warm = await_(pipe.generate(messages=follow, max_tokens=24))
        assert warm["usage"]["cached_tokens"] > 0
        rows = await_(call(pipe, lambda i: m.CacheShow(id=i)))
        assert all(r["evictions"] == 0 and r["disk"]["on"] for r in rows), rows  # nothing evicted yet
    finally:
        pipe.stop_cleanly()  # a drain: what memory holds is written
    yield topology, follow, cold, warm


def await_(coro):
    import trio

    return trio.run(lambda: coro)


def test_a_restart_with_a_populated_disk_tier_restores_and_answers_as_before(conversation, tmp_path):
    topology, follow, cold, warm = conversation
    assert stage_files(tmp_path, 0) and stage_files(tmp_path, 1)  # the drain wrote the resident entries
    pipe = start(topology, tmp_path)
    try:
        after = await_(pipe.generate(messages=follow, max_tokens=24))
        # the same prefix restored as before the restart, the same suffix computed: the same tokens
        assert after["usage"]["cached_tokens"] == warm["usage"]["cached_tokens"] > 0, after["usage"]
        assert after["tokens"] == warm["tokens"]
        assert_same_or_near_tie(after, cold)
        rows = await_(call(pipe, lambda i: m.CacheShow(id=i)))
        for r in rows:
            assert r["disk"]["hits"] >= 1 and r["memory_hits"] == 0 and r["entries"] >= 1, r
        from skippyctl.status import _caches

        assert "on disk" in _caches(pipe.head.status())  # skippyctl status shows the tier too
        # skippyctl cache clear --disk empties both tiers of every stage
        pipe.stop_cleanly()  # a drain: what was promoted and recorded since is on disk again
        pipe = start(topology, tmp_path)
        held = ctl_json(pipe.head, "cache", "show")
        assert all(r["disk"]["entries"] >= 1 for r in held), held
        cleared = ctl_json(pipe.head, "cache", "clear", "--disk")
        for r in cleared:
            assert r["cleared_disk"] == held[r["stage"]]["disk"]["entries"] and r["cleared_disk_bytes"] > 0, r
            assert r["entries"] == 0 and r["disk"]["entries"] == 0 and r["disk"]["bytes"] == 0, r
        assert stage_files(tmp_path, 0) == stage_files(tmp_path, 1) == []
        plain = ctl(pipe.head, "cache", "clear", "--disk")
        assert plain.exit_code == 0 and "stage 1: cleared 0 entries" in plain.stdout, plain.stdout
    finally:
        pipe.stop_cleanly()


def test_a_damaged_entry_makes_a_cold_correct_turn_with_one_warning(conversation, tmp_path):
    topology, follow, cold, _warm = conversation
    for path in stage_files(tmp_path, 1):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10  # inside the KV state: only the checksum can tell
        path.write_bytes(bytes(data))
    pipe = start(topology, tmp_path)
    try:
        after = await_(pipe.generate(messages=follow, max_tokens=24))
        assert after["usage"]["cached_tokens"] == 0, after["usage"]  # stage 1 missed: a whole prefill
        assert after["tokens"] == cold["tokens"]
        log = pipe.stages[1].log()
        lines = [line for line in log.splitlines() if "checksum mismatch" in line]
        assert len(lines) == 1 and "deleted" in lines[0], log[-3000:]
        assert not any(str(p) in lines[0] for p in stage_files(tmp_path, 1))  # that file is gone
    finally:
        pipe.stop_cleanly()


def test_a_re_split_never_uses_the_files_of_the_old_split(conversation, default_model_path, tmp_path):
    _topology, follow, cold, _warm = conversation
    resplit = tmp_path / "resplit"
    topology = split_for_test(default_model_path, 2, resplit, balance="compute")
    old = Topology.load(tmp_path / "topology.toml")
    assert [(s.layer_start, s.layer_end) for s in topology.stages] != \
        [(s.layer_start, s.layer_end) for s in old.stages]
    pipe = start(resplit / "topology.toml", tmp_path, workdir=resplit)
    try:
        for k in (0, 1):  # deleted when the stage started, with one line
            lines = [line for line in pipe.stages[k].log().splitlines() if "another model, split" in line]
            assert len(lines) == 1 and "deleted" in lines[0], pipe.stages[k].log()[-3000:]
            assert stage_files(tmp_path, k) == []
        after = await_(pipe.generate(messages=follow, max_tokens=24))
        assert after["usage"]["cached_tokens"] == 0, after["usage"]
        assert_same_or_near_tie(after, cold)
    finally:
        pipe.stop_cleanly()
