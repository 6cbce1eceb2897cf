"""The prefix cache's disk tier on a real filesystem: what memory evicts is written and found again by the
next process's cache; damaged, truncated and foreign files are misses (deleted, one warning line); the budget
goes least recently used first; one daemon per directory; a full disk turns the tier off and the cache goes on.

The states here are plain bytes (the tier never looks inside them); tests/test_prefix_cache_live.py restores
real ones after a restart.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from skippyd.stage.prefix_cache import PrefixCache
from skippyd.stage.prefix_disk import HEADER_SIZE, LOCK_NAME, SUFFIX, DiskTier, default_dir, stage_identity

IDENTITY = stage_identity(model="sha256:aa", stage_index=1, layers=(15, 30), n_ctx_seq=2048, flash_attn="off")
OTHER_SPLIT = stage_identity(model="sha256:aa", stage_index=1, layers=(12, 30), n_ctx_seq=2048, flash_attn="off")
KIB = 1 << 10


def run(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def state(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def tier(path: Path, budget: int = 1 << 20, identity: bytes = IDENTITY) -> DiskTier:
    return DiskTier(path, budget, identity, stage_index=1).open()


def cache(path: Path, memory: int = 8 * KIB, **kw) -> PrefixCache:
    return PrefixCache(memory, stage_index=1, min_hit=4, disk=tier(path, **kw))


def files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX))


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def fill(c: PrefixCache, n: int = 3, size: int = 5 * KIB) -> list[tuple[np.ndarray, bytes]]:
    """Record ``n`` entries (each evicting the last: memory holds one), then write the resident one too."""
    made = [(run(20, 1000 * k), state(size, k)) for k in range(n)]
    for keys, st in made:
        assert c.record(keys, st)
    c.close()  # a clean stop: what memory holds goes to disk as well
    return made


# ---------------------------------------------------------------------- written, then found by the next process
async def test_evicted_and_resident_entries_are_found_again_after_a_restart(tmp_path):
    first = cache(tmp_path)
    made = fill(first)
    assert first.evictions == 2 and first.disk.writes == 3 and len(files(tmp_path)) == 3
    second = cache(tmp_path)
    assert len(second) == 0 and second.disk.entries == 3
    for keys, st in made:
        query = np.concatenate([keys, run(5, 99_000)])
        hit = await second.lookup_tiers(query)
        assert hit is not None and hit.length == 20 and bytes(hit.entry.state) == st
    stats = second.stats()
    assert (stats.hits, stats.disk_hits, stats.lookups) == (3, 3, 3) and stats.to_json()["memory_hits"] == 0
    # promoted: the last one is in memory now, and memory answers for it
    keys, st = made[-1]
    hit = await second.lookup_tiers(keys)
    assert hit.length == 20 and second.stats().disk_hits == 3 and second.stats().hits == 4
    second.close()


async def test_a_longer_prefix_on_disk_wins_over_a_shorter_one_in_memory(tmp_path):
    c = cache(tmp_path, memory=64 * KIB)
    c.record(run(40), state(KIB, 1))
    c.persist()
    c.disk.flush()
    c.clear()
    c.record(run(10), state(KIB, 2))  # memory: only the first 10
    hit = await c.lookup_tiers(run(45))
    assert hit.length == 40 and bytes(hit.entry.state) == state(KIB, 1) and c.stats().disk_hits == 1
    c.close()


async def test_covered_entries_are_dropped_from_disk(tmp_path):
    """A chat writes each turn's prompt and reply; a longer entry restores every prefix of it."""
    t = tier(tmp_path)
    from skippyd.stage.prefix_cache import CacheEntry

    for n in (20, 30, 40):
        t.put(CacheEntry(run(n), state(KIB, n)))
    t.flush()
    assert t.entries == 1 and len(files(tmp_path)) == 1 and t.find(run(50))[1] == 40
    t.close()


# ---------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("damage", ["flipped byte", "flipped key", "truncated", "longer", "not ours"])
async def test_a_damaged_file_is_a_miss_deleted_with_one_warning(tmp_path, caplog, damage):
    made = fill(cache(tmp_path), n=1)
    (path,) = files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x40  # in the state: only the checksum tells
    elif damage == "flipped key":
        data[HEADER_SIZE + 4 * 10] ^= 0x01  # key 10: the checksum tells
    elif damage == "truncated":
        del data[len(data) - 100:]
    elif damage == "longer":
        data += b"\0" * 10
    else:
        data[:8] = b"GGUF\0\0\0\0"
    path.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING)
    c = cache(tmp_path)
    keys, _ = made[0]
    hit = await c.lookup_tiers(keys)
    assert hit is None
    assert not path.exists() and c.disk.entries == 0
    lines = warnings(caplog)
    assert len(lines) == 1 and str(path) in lines[0] and "deleted" in lines[0], lines
    assert c.record(keys, state(KIB, 9))  # and the cache goes on
    c.close()


async def test_a_damaged_file_falls_back_to_what_memory_holds(tmp_path, caplog):
    c = cache(tmp_path, memory=64 * KIB)
    c.record(run(40), state(KIB, 1))
    c.persist()
    c.disk.flush()
    c.clear()
    (path,) = files(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    c.record(run(10), state(KIB, 2))
    caplog.set_level(logging.WARNING)
    hit = await c.lookup_tiers(run(45))
    assert hit.length == 10 and bytes(hit.entry.state) == state(KIB, 2)
    assert len(warnings(caplog)) == 1 and "checksum" in warnings(caplog)[0]
    c.close()


async def test_files_of_another_split_are_deleted_never_used(tmp_path, caplog):
    fill(cache(tmp_path), n=2)
    caplog.set_level(logging.WARNING)
    other = cache(tmp_path, identity=OTHER_SPLIT)  # the same stage index after a re-split
    assert other.disk.entries == 0 and files(tmp_path) == []
    lines = warnings(caplog)
    assert len(lines) == 1 and "another model, split or context settings" in lines[0], lines
    assert await other.lookup_tiers(run(20)) is None
    other.close()


async def test_a_write_a_crash_interrupted_is_cleaned_up(tmp_path):
    t = tier(tmp_path)
    t.close()
    (tmp_path / ".abc.kv.123.tmp").write_bytes(b"partial")
    t = tier(tmp_path)
    assert not (tmp_path / ".abc.kv.123.tmp").exists() and t.enabled
    t.close()


# ---------------------------------------------------------------------- budget
async def test_the_disk_budget_goes_least_recently_used_first(tmp_path):
    from skippyd.stage.prefix_cache import CacheEntry

    t = tier(tmp_path, budget=22 * KIB)  # four 5 KiB entries (and their headers)
    for k in range(4):
        t.put(CacheEntry(run(20, 1000 * k), state(5 * KIB, k)))
    t.flush()
    assert t.entries == 4
    record, n = t.find(run(20, 0))
    assert n == 20 and t.load(record) is not None  # entry 0 is the most recently used now
    t.put(CacheEntry(run(20, 9000), state(5 * KIB, 9)))
    t.flush()
    held = sorted(int(r.keys[0]) for r in t._index.values())
    assert held == [0, 2000, 3000, 9000] and t.bytes_held <= 22 * KIB
    assert sum(p.stat().st_size for p in files(tmp_path)) == t.bytes_held
    # the order survives a restart, through the files' modification times (made distinct here: a filesystem
    # may give writes within a few milliseconds the same time)
    for age, record in enumerate(reversed(t._index.values())):
        os.utime(tmp_path / record.name, ns=(10**18 - age * 10**9,) * 2)
    t.close()
    t = tier(tmp_path, budget=17 * KIB)  # three fit
    assert sorted(int(r.keys[0]) for r in t._index.values()) == [0, 3000, 9000]
    t.close()


async def test_an_entry_larger_than_the_disk_budget_is_not_written(tmp_path):
    from skippyd.stage.prefix_cache import CacheEntry

    t = tier(tmp_path, budget=4 * KIB)
    assert not t.put(CacheEntry(run(20), state(5 * KIB, 1)))
    t.close()


# ---------------------------------------------------------------------- clear, lock, defaults
async def test_clear_with_disk_empties_the_tier(tmp_path):
    c = cache(tmp_path)
    c.record(run(20), state(KIB, 1))
    c.persist()
    c.disk.flush()
    assert c.clear() == 1 and c.disk.entries == 1
    c.record(run(20, 500), state(KIB, 2))
    assert c.clear(disk=True) == 2 and files(tmp_path) == [] and c.stats().disk_entries == 0
    c.close()


def test_two_daemons_never_share_a_directory(tmp_path, caplog):
    mine = tier(tmp_path)
    caplog.set_level(logging.WARNING)
    script = ("import sys; from pathlib import Path; from skippyd.stage.prefix_disk import DiskTier; "
              "t = DiskTier(Path(sys.argv[1]), 1 << 20, b'x' * 32, stage_index=1).open(); "
              "print(t.enabled, t.off_reason)")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    assert out.stdout.startswith("False ") and f"pid {os.getpid()}" in out.stdout, out
    assert "--prefix-cache-dir" in out.stdout and str(tmp_path / LOCK_NAME) in out.stdout
    mine.close()  # given up: the next one may take it
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    assert out.stdout.startswith("True "), out


def test_the_default_directory_is_the_state_directory_under_systemd():
    assert default_dir({"STATE_DIRECTORY": "/var/lib/skippy:/other"}) == Path("/var/lib/skippy/prefix-cache")
    assert default_dir({}) is None


# ---------------------------------------------------------------------- a full disk
@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


async def test_a_full_disk_turns_the_tier_off_and_the_cache_goes_on(tiny_fs, caplog):
    caplog.set_level(logging.WARNING)
    c = cache(tiny_fs, memory=24 * KIB, budget=1 << 20)  # the budget says 1 MiB, the disk holds 64 KiB
    for k in range(12):  # 20 KiB each: memory keeps one, the disk fills up after three
        assert c.record(run(20, 1000 * k), state(20 * KIB, k))
        c.disk.flush()
    assert not c.disk.enabled and not c.stats().disk_on
    lines = [line for line in warnings(caplog) if "disk tier off" in line]
    assert len(lines) == 1 and "No space left" in lines[0], warnings(caplog)
    assert not list(tiny_fs.glob(".*.tmp"))  # the half-written file is gone
    hit = await c.lookup_tiers(run(30, 11_000))  # memory still answers
    assert hit is not None and hit.length == 20
    c.close()


# ---------------------------------------------------------------------- boundary rows
async def test_boundary_rows_go_to_disk_and_come_back_with_their_entry(tmp_path):
    rows = np.random.default_rng(5).standard_normal((20, 8)).astype(np.float32)
    c = cache(tmp_path, memory=64 * KIB)
    assert c.record(run(20), state(KIB, 1), rows[:15])  # rows for the first 15 positions only
    assert c.stats().bytes_held == KIB + 20 * 4 + 15 * 8 * 4
    c.close()
    c = cache(tmp_path, memory=64 * KIB)
    hit = await c.lookup_tiers(run(25))
    assert hit.length == 20 and hit.entry.boundary_len == 15 and np.array_equal(hit.entry.boundary, rows[:15])
    c.close()


def test_boundary_rows_follow_the_sequence():
    from skippyd.stage.boundary import BoundaryRows

    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    b = BoundaryRows()
    b.wrote(0, rows[:6])
    b.wrote(6, rows[6:7])  # a decode step
    assert b.held == 7 and np.array_equal(b.view(2, 7), rows[2:7])
    b.wrote(9, rows[9:])  # a gap: not kept
    assert b.held == 7
    b.trim(4)  # the sequence was trimmed
    assert b.held == 4 and np.array_equal(b.copy(10), rows[:4])
    b.wrote(4, rows[4:10])
    assert b.held == 10 and np.array_equal(b.copy(10), rows)
    b.load(rows, 3)
    assert b.held == 3 and b.copy(0) is None
    b.load(None, 5)
    assert b.held == 0 and b.copy(5) is None
