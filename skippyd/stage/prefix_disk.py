"""A stage's prefix cache on disk: the entries memory evicted, and those it held at a clean stop.

One file per entry, in a directory of the stage's own (``DIR/stage-K``),
named by a digest of its keys. A file is a header (magic, format, the
stage's identity, the key, state and boundary lengths), the keys (int32), the
state (``Context.state_export``'s bytes), the boundary rows (float32, a stage
before the final one: skippyd/stage/boundary.py) and a SHA-256 of everything
before it.

The identity is a digest of what makes a state importable here: the model
slice, its layer range, the KV type and the context settings (see
:func:`stage_identity`). A file of another identity (another model, a
re-split, other context settings) is never used: it is deleted when the
directory is scanned. A file whose length or checksum is wrong (truncated,
a flipped byte) is a miss: deleted, with one warning line. Files are written
to a temporary name and renamed, so a crash leaves either the whole file or
a temporary one (deleted at the next start).

Writes happen on a worker thread of their own: :meth:`DiskTier.put` only
queues the entry (its state is never changed, so nothing is copied), and the
decode steps on the event loop never wait for a disk. Reads (a promotion)
run in a worker thread too (see PrefixCache.lookup_tiers). The budget counts
the files' bytes; the least recently used go first (the order survives a
restart through the files' modification times, which a read touches). A full
disk (ENOSPC, EDQUOT) turns the tier off with a warning; serving goes on
from memory. A lock file in the directory (``owner.lock``, holding the
owner's pid and host) keeps a second daemon from using it at the same time:
that one runs without a disk tier and says why.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import socket
import struct
import threading
from collections import OrderedDict
from pathlib import Path

import attrs
import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"SKIPPYKV"
FORMAT = 2
# magic, format, identity digest, key count, state bytes, boundary rows, their width (n_embd; 0: no rows)
_HEADER = struct.Struct("<8sI32sQQII")
HEADER_SIZE = _HEADER.size  # 68
DIGEST_SIZE = 32
SUFFIX = ".kv"
LOCK_NAME = "owner.lock"
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
KV_TYPE = "f16"  # the contexts' KV cache type (ContextParams never overrides llama.cpp's default)


def stage_identity(*, model: str, stage_index: int, layers: tuple[int, int], n_ctx_seq: int,
                   flash_attn: str) -> bytes:
    """The digest a file must carry to be used by this stage: the model slice (its sha256, or what names the
    file), the stage and its layer range, the KV type and the context settings that shape a sequence's state
    (flash attention stores V transposed or not)."""
    text = json.dumps({"format": FORMAT, "model": model, "stage": stage_index, "layers": list(layers),
                       "kv_type": KV_TYPE, "n_ctx_seq": n_ctx_seq, "flash_attn": flash_attn}, sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


def default_dir(environ: dict[str, str] | None = None) -> Path | None:
    """$STATE_DIRECTORY/prefix-cache under systemd; None (no disk tier) outside it."""
    env = os.environ if environ is None else environ
    state = env.get("STATE_DIRECTORY")
    return Path(state.split(":")[0]) / "prefix-cache" if state else None


def _file_size(n_keys: int, n_state: int, n_rows: int, width: int) -> int:
    return _HEADER.size + 4 * n_keys + n_state + 4 * n_rows * width + DIGEST_SIZE


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The number of leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def file_name(keys: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(keys, dtype="<i4").tobytes()).hexdigest()[:40] + SUFFIX


@attrs.define(eq=False)
class DiskRecord:
    """A file of the tier, as the index holds it: its keys (read when the directory was scanned) and size."""

    name: str
    keys: np.ndarray
    size: int


class DiskTierUnavailable(Exception):
    """The directory cannot be used (not creatable, or another daemon's lock holds it)."""


class DiskTier:
    """The files of one stage's prefix cache on disk (see the module docstring)."""

    def __init__(self, directory: Path, budget_bytes: int, identity: bytes, *, stage_index: int,
                 queue_bytes: int | None = None):
        self.dir = Path(directory)
        self.budget_bytes = max(0, int(budget_bytes))
        self.identity = identity
        self.stage_index = stage_index
        self.enabled = False
        self.off_reason: str | None = "not opened"
        self._index: OrderedDict[str, DiskRecord] = OrderedDict()  # least recently used first
        self._mutex = threading.Lock()  # the index and the counters: the writer thread and the event loop
        self._queue: queue.Queue = queue.Queue()
        # entries waiting for the writer hold memory outside the memory budget: at most this many bytes
        self._queue_limit = queue_bytes if queue_bytes is not None else max(64 << 20, self.budget_bytes // 8)
        self._queued_bytes = 0
        self._writer: threading.Thread | None = None
        self._lock_fd: int | None = None
        self.bytes_held = 0
        self.hits = 0
        self.writes = 0
        self.dropped_writes = 0  # entries not written: the queue was full, or the tier went off
        self.discarded = 0  # files deleted as corrupt, truncated or foreign

    # ------------------------------------------------------------------ life
    def open(self) -> DiskTier:
        """Take the directory (its lock), scan its files and start the writer. A directory that cannot be used
        leaves the tier off, with one warning line; the stage serves from memory."""
        if self.budget_bytes <= 0:
            self.off_reason = "budget 0"
            return self
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._take_lock()
            self._scan()
        except (OSError, DiskTierUnavailable) as exc:
            self._release_lock()
            self.off_reason = str(exc) if isinstance(exc, DiskTierUnavailable) else \
                f"{self.dir}: {exc.strerror or exc}"
            log.warning("stage %d: prefix cache disk tier off: %s", self.stage_index, self.off_reason)
            return self
        self.enabled, self.off_reason = True, None
        self._writer = threading.Thread(target=self._write_loop, name=f"prefix-disk-{self.stage_index}",
                                        daemon=True)
        self._writer.start()
        log.info("stage %d: prefix cache disk tier in %s: %d entries, %.1f of %.0f MiB", self.stage_index,
                 self.dir, len(self._index), self.bytes_held / 2**20, self.budget_bytes / 2**20)
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout`` seconds), stop the writer and give the directory up."""
        writer = self._writer
        if writer is not None:
            self._queue.put(None)
            writer.join(timeout)
            self._writer = None
        self.enabled = False
        self.off_reason = self.off_reason or "closed"
        self._release_lock()

    def _take_lock(self) -> None:
        path = self.dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DiskTierUnavailable(f"{self.dir} is in use by {owner} (its lock file {path}); give each "
                                      f"daemon its own --prefix-cache-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock; the file stays (it names no one then)
            self._lock_fd = None

    def _scan(self) -> None:
        """Index the directory's files, least recently used first; delete leftovers, foreign and damaged
        files."""
        found, foreign = [], 0
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):  # a write a crash interrupted
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                keys, size, why = self._read_head(path)
                mtime = path.stat().st_mtime_ns
            except OSError:
                continue
            if why == "foreign":
                foreign += 1
                path.unlink(missing_ok=True)
            elif why is not None:
                self._discard(path, why)
            else:
                found.append((mtime, DiskRecord(path.name, keys, size)))
        if foreign:
            self.discarded += foreign
            log.warning("stage %d: prefix cache disk tier: deleted %d entries of another model, split or "
                        "context settings in %s", self.stage_index, foreign, self.dir)
        for _mtime, record in sorted(found, key=lambda item: item[0]):
            self._index[record.name] = record
            self.bytes_held += record.size
        self._make_room(0)

    def _read_head(self, path: Path) -> tuple[np.ndarray | None, int, str | None]:
        """The file's keys and size, and why it cannot be used (None: it can, if its checksum holds)."""
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                return None, size, "truncated"
            magic, fmt, identity, n_keys, n_state, n_rows, width = _HEADER.unpack(head)
            if magic != MAGIC or fmt != FORMAT:
                return None, size, "not a prefix cache file"
            if identity != self.identity:
                return None, size, "foreign"
            expected = _file_size(n_keys, n_state, n_rows, width)
            if size != expected:
                return None, size, "truncated" if size < expected else "longer than its header says"
            keys = np.frombuffer(f.read(4 * n_keys), dtype="<i4").astype(np.int32)
        return keys, size, None

    def _discard(self, path: Path, why: str) -> None:
        """Delete a damaged file, with one warning line: a miss, never a wrong answer."""
        path.unlink(missing_ok=True)
        with self._mutex:
            record = self._index.pop(path.name, None)
            if record is not None:
                self.bytes_held -= record.size
            self.discarded += 1
        log.warning("stage %d: prefix cache disk tier: deleted %s (%s); a miss, computed again",
                    self.stage_index, path, why)

    # ------------------------------------------------------------------ lookup (the event loop)
    def find(self, query: np.ndarray) -> tuple[DiskRecord | None, int]:
        """The record sharing the longest prefix with ``query``, and its length (0: none)."""
        if not self.enabled:
            return None, 0
        best, best_len = None, 0
        with self._mutex:
            records = list(self._index.values())
        for record in records:
            n = common_prefix(record.keys, query)
            if n > best_len:
                best, best_len = record, n
        return best, best_len

    def load(self, record: DiskRecord) -> tuple[np.ndarray, bytes, np.ndarray | None] | None:
        """The record's keys, state and boundary rows, its checksum verified, now the most recently used; None
        when the file is gone or damaged (deleted, one warning line). Blocking: run it in a worker thread."""
        path = self.dir / record.name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            with self._mutex:
                if self._index.pop(record.name, None) is not None:
                    self.bytes_held -= record.size
            return None
        except OSError as exc:
            log.warning("stage %d: prefix cache disk tier: cannot read %s: %s", self.stage_index, path,
                        exc.strerror or exc)
            return None
        why = self._check(data)
        if why is not None:
            self._discard(path, why)
            return None
        _magic, _fmt, _identity, n_keys, n_state, n_rows, width = _HEADER.unpack_from(data)
        keys = np.frombuffer(data, dtype="<i4", count=n_keys, offset=_HEADER.size).astype(np.int32)
        start = _HEADER.size + 4 * n_keys
        state = memoryview(data)[start:start + n_state]
        boundary = None
        if n_rows and width:
            boundary = np.frombuffer(data, dtype="<f4", count=n_rows * width, offset=start + n_state)
            boundary = boundary.reshape(n_rows, width).astype(np.float32)
        with self._mutex:
            if record.name in self._index:
                self._index.move_to_end(record.name)
            self.hits += 1
        try:
            os.utime(path)  # the order survives a restart
        except OSError:
            pass
        return keys, bytes(state), boundary

    def _check(self, data: bytes) -> str | None:
        if len(data) < _HEADER.size + DIGEST_SIZE:
            return "truncated"
        magic, fmt, identity, n_keys, n_state, n_rows, width = _HEADER.unpack_from(data)
        if magic != MAGIC or fmt != FORMAT:
            return "not a prefix cache file"
        if identity != self.identity:
            return "of another model, split or context settings"
        if len(data) != _file_size(n_keys, n_state, n_rows, width):
            return "truncated"
        if hashlib.sha256(memoryview(data)[:-DIGEST_SIZE]).digest() != data[-DIGEST_SIZE:]:
            return "checksum mismatch"
        return None

    # ------------------------------------------------------------------ writes
    def holds(self, keys: np.ndarray) -> bool:
        """Whether the tier has a file for exactly these keys."""
        with self._mutex:
            return file_name(keys) in self._index

    def put(self, entry, *, resident: bool = False) -> bool:
        """Queue ``entry`` (a CacheEntry) for the writer; never blocks. False if not queued (off, too large
        for the budget, or the queue holds its limit of bytes already: evicted entries wait there outside the
        memory budget; ``resident`` ones, still in memory, are always queued)."""
        if not self.enabled or entry.nbytes + _HEADER.size + DIGEST_SIZE > self.budget_bytes:
            return False
        with self._mutex:
            if not resident and self._queued_bytes + entry.nbytes > self._queue_limit:
                self.dropped_writes += 1
                return False
            self._queued_bytes += entry.nbytes
        self._queue.put(entry)
        return True

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until everything queued so far is written (blocking: a worker thread). True if it was."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout) if self._writer is not None else False

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if self.enabled:
                    self._write(item)
                else:
                    self.dropped_writes += 1
            except Exception:  # a bug must cost one entry, never the stage
                log.exception("stage %d: prefix cache disk tier: writing an entry failed", self.stage_index)
            finally:
                with self._mutex:
                    self._queued_bytes -= item.nbytes

    def _write(self, entry) -> None:
        keys = np.ascontiguousarray(entry.keys, dtype="<i4")
        name = file_name(keys)
        path = self.dir / name
        with self._mutex:
            held = self._index.get(name)
            if held is not None:
                self._index.move_to_end(name)
        if held is not None:
            try:
                os.utime(path)
            except OSError:
                pass
            return
        boundary = getattr(entry, "boundary", None)
        rows = b"" if boundary is None else np.ascontiguousarray(boundary, dtype="<f4").tobytes()
        n_rows, width = (0, 0) if boundary is None else boundary.shape
        size = _file_size(len(keys), len(entry.state), n_rows, width)
        self._make_room(size)
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        digest = hashlib.sha256()
        try:
            with tmp.open("wb") as f:
                for part in (_HEADER.pack(MAGIC, FORMAT, self.identity, len(keys), len(entry.state), n_rows, width),
                             keys.tobytes(), entry.state, rows):
                    digest.update(part)
                    f.write(part)
                f.write(digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in FULL_ERRNOS:
                self.enabled = False
                self.off_reason = f"{self.dir}: {exc.strerror}"
                log.warning("stage %d: prefix cache disk tier off: %s (serving goes on from memory)",
                            self.stage_index, self.off_reason)
            else:
                self.dropped_writes += 1
                log.warning("stage %d: prefix cache disk tier: cannot write %s: %s", self.stage_index, path,
                            exc.strerror or exc)
            return
        covered = []
        with self._mutex:
            self._index[name] = DiskRecord(name, np.array(keys, dtype=np.int32), size)
            self.bytes_held += size
            self.writes += 1
            n = len(keys)
            for other in list(self._index.values()):  # entries this one holds all of: a longer one restores them
                if other.name != name and len(other.keys) <= n and np.array_equal(other.keys, keys[:len(other.keys)]):
                    covered.append(self._index.pop(other.name))
                    self.bytes_held -= other.size
        for record in covered:
            (self.dir / record.name).unlink(missing_ok=True)

    def _make_room(self, size: int) -> None:
        """Delete the least recently used files until ``size`` more bytes fit the budget."""
        while True:
            with self._mutex:
                if not self._index or self.bytes_held + size <= self.budget_bytes:
                    return
                record = self._index.popitem(last=False)[1]
                self.bytes_held -= record.size
            (self.dir / record.name).unlink(missing_ok=True)

    def clear(self) -> int:
        """Delete every file of the tier; returns how many there were."""
        with self._mutex:
            records = list(self._index.values())
            self._index.clear()
            self.bytes_held = 0
        for record in records:
            (self.dir / record.name).unlink(missing_ok=True)
        return len(records)

    # ------------------------------------------------------------------ report
    @property
    def entries(self) -> int:
        return len(self._index)

    @property
    def tokens_held(self) -> int:
        with self._mutex:
            return sum(len(r.keys) for r in self._index.values())

    def describe(self) -> dict:
        return {"dir": str(self.dir), "enabled": self.enabled, "off_reason": self.off_reason,
                "budget_bytes": self.budget_bytes, "bytes": self.bytes_held, "entries": self.entries,
                "hits": self.hits, "writes": self.writes, "dropped_writes": self.dropped_writes,
                "discarded": self.discarded}


def model_digest(sha256: str | None, path: Path) -> str:
    """What names a stage's model file in its identity: the slice's sha256 (a topology records it), else the
    resolved file with its size and modification time (a whole model run with --model)."""
    if sha256:
        return f"sha256:{sha256}"
    st = Path(path).stat()
    return f"file:{Path(path).resolve()}:{st.st_size}:{st.st_mtime_ns}"


def open_disk_tier(directory: Path | None, budget_mb: int, *, stage_index: int, model: str,
                   layers: tuple[int, int], context) -> DiskTier | None:
    """The disk tier of a stage (in ``directory/stage-K``), opened; None when there is no directory or its
    budget is 0. Blocking (it scans the directory): run it in a worker thread."""
    if directory is None or budget_mb <= 0:
        return None
    identity = stage_identity(model=model, stage_index=stage_index, layers=layers, n_ctx_seq=context.n_ctx_seq,
                              flash_attn=context.params.flash_attn)
    return DiskTier(Path(directory) / f"stage-{stage_index}", budget_mb << 20, identity,
                    stage_index=stage_index).open()
