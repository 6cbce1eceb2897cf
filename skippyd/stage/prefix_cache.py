"""A stage's prefix cache: the KV of its own layers for token prefixes it has computed, kept in host memory.

An entry is the exact keys of a sequence's positions (their token ids; a
media position, an image's, has a negative key made from the image's pixels
and its place, see skippyd.head.prompt) and that sequence's state as llama.cpp
exports it (``Context.state_export``: the KV of this stage's layers for those
positions). A later prompt that begins with the same keys
restores the entry into its own sequence and trims it to the common prefix
(:meth:`PrefixCache.lookup`), so only the rest is computed. Entries are
looked up by longest common prefix; a hit shorter than ``min_hit`` tokens
is not worth its import and counts as a miss.

The cache belongs to one stage process, whose model, layer range and context
settings are fixed for its life, so the positions' keys are the whole key in
memory. A disk tier (:class:`~skippyd.stage.prefix_disk.DiskTier`, when the
stage has a directory for it) keeps the entries memory evicts and those it
holds at a clean stop, keyed also by what makes a state importable (model,
split, context settings): a lookup that finds a longer prefix on disk than in
memory promotes that entry (:meth:`PrefixCache.lookup_tiers`), so a restart
starts warm and a re-split starts empty. The memory budget counts the bytes held (the
states, their token arrays and, before the final stage, the hidden states recorded with them); the least
recently used entries go first,
and an entry larger than the budget is not kept. A restore copies an entry
into the session's sequence, so evicting it never takes anything from a
running session.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import attrs
import numpy as np
import trio

from skippyd.stage.prefix_disk import DiskTier, common_prefix
from skippyd.wire.messages import CacheStats

log = logging.getLogger(__name__)

MIN_HIT = 16  # a common prefix shorter than this is recomputed rather than restored


@attrs.define(eq=False)
class CacheEntry:
    keys: np.ndarray  # int32, the keys of the sequence's positions (token ids, or media keys)
    state: bytes | bytearray  # llama.cpp's per-sequence state for exactly those positions (never changed)
    # a stage before the final one: the hidden states it sent on for the first len(boundary) positions
    # (skippyd/stage/boundary.py), float32 (n, n_embd); None: none recorded
    boundary: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return len(self.state) + self.keys.nbytes + (0 if self.boundary is None else self.boundary.nbytes)

    @property
    def boundary_len(self) -> int:
        return 0 if self.boundary is None else len(self.boundary)


@attrs.frozen
class Hit:
    entry: CacheEntry
    length: int  # positions of the entry that the query shares


class PrefixCache:
    """Entries of one stage, least recently used first (see the module docstring)."""

    def __init__(self, budget_bytes: int, *, stage_index: int, min_hit: int = MIN_HIT,
                 disk: DiskTier | None = None):
        self.budget_bytes = max(0, int(budget_bytes))
        self.stage_index = stage_index
        self.min_hit = max(1, min_hit)
        self.disk = disk  # the disk tier (opened by its owner), or None
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._next_key = 0
        self.bytes_held = 0
        self.lookups = 0
        self.hits = 0
        self.restored_tokens = 0
        self.recorded_tokens = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def disk_on(self) -> bool:
        return self.disk is not None and self.disk.enabled

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: np.ndarray, limit: int | None = None) -> Hit | None:
        """The memory entry sharing the longest prefix with ``keys[:limit]`` (at least ``min_hit`` positions),
        now the most recently used; None on a miss. Counted as a lookup (and a hit), unless the query is too
        short to hit at all (a prompt of a token or a few: nothing is looked up). See also lookup_tiers."""
        query = keys if limit is None else keys[:limit]
        if not self.enabled or len(query) < self.min_hit:
            return None
        self.lookups += 1
        return self._memory_hit(query)

    async def lookup_tiers(self, keys: np.ndarray, limit: int | None = None) -> Hit | None:
        """As :meth:`lookup`, over memory and the disk tier: an entry on disk that shares a longer prefix than
        any in memory is read (in a worker thread, its checksum verified), promoted into memory and returned;
        a damaged file is a miss (deleted, one warning line), and memory's hit, if any, is used instead."""
        query = keys if limit is None else keys[:limit]
        if not self.enabled or len(query) < self.min_hit:
            return None
        disk = self.disk
        if disk is None or not disk.enabled:
            return self.lookup(keys, limit)
        self.lookups += 1
        memory_len = max((common_prefix(e.keys, query) for e in self._entries.values()), default=0)
        record, disk_len = await trio.to_thread.run_sync(disk.find, query)  # many files: not on the loop
        if record is not None and disk_len > memory_len and disk_len >= self.min_hit:
            loaded = await trio.to_thread.run_sync(disk.load, record)
            if loaded is not None:
                entry = CacheEntry(*loaded)
                self.hits += 1
                self._keep(entry)
                return Hit(entry, common_prefix(entry.keys, query))
        return self._memory_hit(query)

    def _memory_hit(self, query: np.ndarray) -> Hit | None:
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            n = common_prefix(entry.keys, query)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None or best_len < self.min_hit:
            return None
        self.hits += 1
        self._entries.move_to_end(best_key)
        return Hit(self._entries[best_key], best_len)

    def note_restored(self, n_tokens: int) -> None:
        """A hit's tokens that were restored and used (the chain may use fewer than this stage's hit)."""
        self.restored_tokens += n_tokens

    # ------------------------------------------------------------------ record
    def wants(self, keys: np.ndarray) -> bool:
        """Whether an entry for ``keys`` would add anything: long enough, not already held by an entry that
        begins with them, and an export of them could fit the budget (checked again by :meth:`record`)."""
        if not self.enabled or len(keys) < self.min_hit:
            return False
        n = len(keys)
        for entry in self._entries.values():
            if len(entry.keys) >= n and common_prefix(entry.keys, keys) == n:
                return False
        return True

    def record(self, keys: np.ndarray, state: bytes | bytearray, boundary: np.ndarray | None = None) -> bool:
        """Keep ``state`` (the exported sequence) for ``keys`` (with the stage's ``boundary`` rows, if it
        recorded them; kept as given); entries it covers (their keys are a prefix of these) are dropped, then
        the least recently used ones until it fits. False if not kept."""
        if not self.wants(keys):
            return False
        if not self._keep(CacheEntry(np.array(keys, dtype=np.int32, copy=True), state, boundary)):
            return False
        self.recorded_tokens += len(keys)
        return True

    def _keep(self, entry: CacheEntry) -> bool:
        """Hold ``entry``: the entries it covers go, then the least recently used (to the disk tier) until it
        fits. False if it is larger than the budget."""
        if entry.nbytes > self.budget_bytes:
            return False
        n = len(entry.keys)
        for key, old in list(self._entries.items()):
            if len(old.keys) <= n and common_prefix(old.keys, entry.keys) == len(old.keys):
                self._drop(key)
        while self._entries and self.bytes_held + entry.nbytes > self.budget_bytes:
            self._evict(next(iter(self._entries)))
        self._entries[self._next_key] = entry
        self._next_key += 1
        self.bytes_held += entry.nbytes
        return True

    def _drop(self, key: int) -> CacheEntry:
        entry = self._entries.pop(key)
        self.bytes_held -= entry.nbytes
        return entry

    def _evict(self, key: int) -> None:
        """Drop an entry to stay within the budget; the disk tier keeps it (written by its own thread)."""
        entry = self._drop(key)
        self.evictions += 1
        if self.disk is not None:
            self.disk.put(entry)

    def resize(self, budget_bytes: int) -> None:
        """A new budget; entries over it go, least recently used first."""
        self.budget_bytes = max(0, int(budget_bytes))
        while self._entries and self.bytes_held > self.budget_bytes:
            self._evict(next(iter(self._entries)))

    def persist(self) -> int:
        """Queue every entry held for the disk tier, least recently used first (a clean stop or a drain; they
        stay in memory). Returns how many were queued."""
        disk = self.disk
        if disk is None or not disk.enabled:
            return 0
        return sum(disk.put(entry, resident=True) for entry in list(self._entries.values())
                   if not disk.holds(entry.keys))

    async def write_through(self, timeout: float = 60.0) -> int:
        """persist, then wait (in a worker thread) until the disk tier has written them. Returns how many were
        queued (those it holds already are not written again)."""
        queued = self.persist()
        if queued:
            if not await trio.to_thread.run_sync(self.disk.flush, timeout, abandon_on_cancel=True):
                log.warning("stage %d: prefix cache: writing %d entries to disk took over %gs", self.stage_index,
                            queued, timeout)
        return queued

    def close(self) -> None:
        """A clean stop: write the entries held to the disk tier (blocking), then close it."""
        if self.disk is not None:
            self.persist()
            self.disk.close()

    def clear(self, disk: bool = False) -> int:
        """Drop every entry (with ``disk``, the disk tier's too); returns how many there were."""
        n = len(self._entries)
        self._entries.clear()
        self.bytes_held = 0
        if disk and self.disk is not None:
            n += self.disk.clear()
        return n

    # ------------------------------------------------------------------ report
    def stats(self) -> CacheStats:
        disk = self.disk
        on_disk = {} if disk is None else dict(
            disk_on=disk.enabled, disk_budget_bytes=disk.budget_bytes, disk_bytes=max(0, disk.bytes_held),
            disk_entries=disk.entries, disk_tokens=disk.tokens_held, disk_hits=disk.hits, disk_writes=disk.writes)
        return CacheStats(self.stage_index, self.budget_bytes, self.bytes_held, len(self._entries),
                          sum(len(e.keys) for e in self._entries.values()), self.lookups, self.hits,
                          self.restored_tokens, self.recorded_tokens, self.evictions, **on_disk)


# ---------------------------------------------------------------------- a sequence's KV in and out of the cache
async def restore_into(scheduler, context, seq: int, hit: Hit, length: int) -> bool:
    """Make ``seq`` hold the first ``length`` positions of ``hit``'s entry (whatever it held before is
    dropped). False if llama.cpp refused the state; ``seq`` is then empty."""
    restored = False

    def restore() -> None:
        nonlocal restored
        context.kv_clear_seq(seq)
        try:
            context.state_import(seq, hit.entry.state)
            context.kv_trim(seq, length)
            restored = True
        finally:
            if not restored:
                context.kv_clear_seq(seq)

    await scheduler.run_kv(restore)
    return restored


async def record_from(cache: PrefixCache, scheduler, context, seq: int, keys: np.ndarray, *,
                      clear: bool = False, rows=None) -> bool:
    """Keep ``seq``'s KV (its positions [0, len(keys)), whose keys are ``keys``) if the cache wants it, with
    the boundary rows of ``rows`` (a BoundaryRows, for a stage before the final one); with ``clear``, empty
    ``seq`` afterwards in the same KV operation (whatever the export did). True if kept."""
    wanted = cache.wants(keys)
    state = None

    def export() -> None:
        nonlocal state
        try:
            if wanted:
                context.kv_trim(seq, len(keys))  # nothing past the positions the keys name
                state = context.state_export(seq)
        finally:
            if clear:
                context.kv_clear_seq(seq)

    if not wanted and not clear:
        return False
    await scheduler.run_kv(export)
    boundary = rows.copy(len(keys)) if rows is not None and state is not None else None
    return state is not None and cache.record(keys, state, boundary)
