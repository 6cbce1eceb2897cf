"""The prefix cache: its bookkeeping (no model), and restores on real libllama contexts.

A restored prefix followed by a suffix prefill can round differently from one
whole prefill (another batch shape); what must hold bit for bit is that the
restored KV *is* the KV that was computed: the same positions computed after
it, with the same batch boundaries, give identical logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from skippyd.runtime.llama import ContextParams
from skippyd.runtime.slicing import split_model
from skippyd.stage.prefix_cache import PrefixCache, common_prefix, record_from, restore_into
from tests.local_pipeline import LocalPipeline

PARAMS = ContextParams(n_ctx_per_seq=1024, n_seq_max=3, n_batch=256, n_ubatch=256, n_threads=2)


def toks(*values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def run(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


# ---------------------------------------------------------------------- bookkeeping
def test_common_prefix():
    assert common_prefix(toks(1, 2, 3), toks(1, 2, 4)) == 2
    assert common_prefix(toks(1, 2), toks(1, 2, 3)) == 2
    assert common_prefix(toks(5), toks(1)) == 0
    assert common_prefix(toks(), toks(1)) == 0


def test_lookup_finds_the_longest_common_prefix_and_ignores_short_hits():
    cache = PrefixCache(1 << 20, stage_index=0, min_hit=4)
    cache.record(run(10), b"a" * 10)
    cache.record(np.concatenate([run(6), run(10, 100)]), b"b" * 10)
    hit = cache.lookup(np.concatenate([run(8), toks(-1)]))
    assert hit.length == 8 and hit.entry.state == b"a" * 10
    assert cache.lookup(np.concatenate([run(6), toks(100, 101)])).entry.state == b"b" * 10
    assert cache.lookup(toks(0, 1, 2, 9, 9)) is None  # 3 shared tokens: under min_hit
    assert cache.lookup(run(10), limit=5).length == 5  # never past the limit
    # too short to hit at all (a one-token prompt leaves an empty query): not a lookup, so not in the hit rate
    assert cache.lookup(run(1), limit=0) is None and cache.lookup(run(3)) is None
    stats = cache.stats()
    assert (stats.lookups, stats.hits) == (4, 3)


def test_an_entry_replaces_the_entries_it_begins_with():
    cache = PrefixCache(1 << 20, stage_index=0, min_hit=4)
    assert cache.record(run(8), b"x" * 8)
    assert not cache.wants(run(6))  # held already, inside the longer entry
    assert not cache.record(run(8), b"x" * 8)
    assert cache.record(run(12), b"y" * 12)  # the next turn begins with the last one
    assert len(cache) == 1 and cache.bytes_held == 12 + 12 * 4
    assert cache.stats().recorded_tokens == 20


def test_least_recently_used_entries_go_first_and_the_budget_holds():
    entry = 1000 + 16 * 4  # state bytes + token bytes
    cache = PrefixCache(3 * entry, stage_index=2, min_hit=4)
    for k in range(3):
        cache.record(run(16, 100 * k), bytes(1000))
    cache.lookup(run(16, 0))  # the first is used again: the second is now the oldest
    cache.record(run(16, 300), bytes(1000))
    assert cache.lookup(run(16, 100)) is None
    assert cache.lookup(run(16, 0)) is not None and cache.lookup(run(16, 200)) is not None
    stats = cache.stats()
    assert stats.evictions == 1 and stats.entries == 3 and stats.bytes_held == 3 * entry <= stats.budget_bytes
    assert stats.stage_index == 2
    assert not cache.record(run(16, 900), bytes(4 * entry))  # larger than the whole budget: not kept, no error
    assert len(cache) == 3
    cache.resize(entry)
    assert len(cache) == 1 and cache.bytes_held <= entry
    assert cache.clear() == 1 and cache.bytes_held == 0 and cache.lookup(run(16, 0)) is None


def test_a_zero_budget_is_off():
    cache = PrefixCache(0, stage_index=0)
    assert not cache.enabled
    assert not cache.record(run(100), b"x")
    assert cache.lookup(run(100)) is None and cache.stats().lookups == 0


# ---------------------------------------------------------------------- on real contexts
class Immediately:
    """A scheduler with nothing else to run: KV operations run at once."""

    async def run_kv(self, op) -> None:
        op()


@pytest.fixture(scope="module")
def two_stages(default_model_path, tmp_path_factory):
    topo = split_model(default_model_path, None, tmp_path_factory.mktemp("cache2"), stages=2)
    with LocalPipeline([s.file for s in topo.stages], PARAMS) as pipe:
        yield pipe


def _prompt(pipe) -> np.ndarray:
    text = ("Lighthouses stand on rocky headlands and guide ships through narrow channels at night. " * 4
            + "Write one more sentence about them:")
    return np.asarray(pipe.head.tokenize(text), dtype=np.int32)


async def test_restored_kv_continues_bit_for_bit_like_the_kv_it_was_exported_from(two_stages):
    """Each stage's prefix KV goes through its cache (export, record, lookup, import into another sequence);
    the suffix computed after it in the same chunks gives the same logits, bit for bit, and the same
    greedy continuation."""
    pipe = two_stages
    prompt = _prompt(pipe)
    n, cut = len(prompt), len(prompt) - 9
    for ctx in pipe.contexts:
        ctx.kv_clear_seq(0), ctx.kv_clear_seq(1)
    pipe.prefill(prompt[:cut], seq=0, chunk=32)
    caches = [PrefixCache(64 << 20, stage_index=k) for k in range(len(pipe.contexts))]
    for cache, ctx in zip(caches, pipe.contexts):
        assert await record_from(cache, Immediately(), ctx, 0, prompt[:cut])
        hit = cache.lookup(prompt, n - 1)
        assert hit.length == cut
        assert await restore_into(Immediately(), ctx, 1, hit, hit.length)
        assert ctx.kv_pos_range(1) == (0, cut - 1)
    logits, continued = [], []
    for seq in (0, 1):
        pipe.prefill(prompt[cut:], seq=seq, start=cut, chunk=32)
        logits.append(pipe.last.logits(seq).copy())
        continued.append(pipe.continue_decode(n, 8, seq=seq, stop_at_eog=False))
    assert np.array_equal(logits[0], logits[1])
    assert continued[0] == continued[1]


async def test_a_restore_shorter_than_the_entry_holds_only_the_shared_positions(two_stages):
    pipe = two_stages
    prompt = _prompt(pipe)
    for c in pipe.contexts:
        c.kv_clear_seq(0), c.kv_clear_seq(2)
    pipe.prefill(prompt, seq=0)
    ctx = pipe.contexts[0]
    cache = PrefixCache(64 << 20, stage_index=0)
    assert await record_from(cache, Immediately(), ctx, 0, prompt, clear=True)
    assert ctx.kv_pos_range(0) is None  # cleared after the export
    other = np.concatenate([prompt[:20], np.full(10, 7, dtype=np.int32)])
    hit = cache.lookup(other)
    assert hit.length == 20
    assert await restore_into(Immediately(), ctx, 2, hit, hit.length)
    assert ctx.kv_pos_range(2) == (0, 19)
    assert cache.stats().bytes_held == len(hit.entry.state) + prompt.nbytes
