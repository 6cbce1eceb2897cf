"""The slices a host holds for deployments: received in chunks, kept by their sha256, checked before use.

A slice is stored as ``DIR/<sha256>.gguf`` only once every byte arrived and the
whole file hashed to its name. While it arrives it is ``DIR/<sha256>.part``,
written in order: an interrupted transfer keeps what arrived, and the next one
asks for the rest (``offer`` answers how much is there). A held slice whose
bytes no longer match its name (a bad disk, a hand edit) is found at the next
``offer``, deleted and received again. The hash of a held file is remembered
with its size and modification time, so a second deployment does not read
every slice again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

import attrs

from skippyd.control.messages import RequestFailed

log = logging.getLogger("skippyd.deploy")

# the most bytes one chunk may carry: base64 in a JSON control message, under the websocket's 1 MiB per message
CHUNK_MAX = 640 << 10
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class SliceStoreError(RequestFailed):
    """A slice request that cannot be served; ``code`` says what kind (the control channel's error code)."""


def default_slices_dir(environ: dict[str, str] | None = None) -> Path:
    """$STATE_DIRECTORY/slices under systemd, else $XDG_STATE_HOME (~/.local/state)/skippy/slices."""
    env = os.environ if environ is None else environ
    state = env.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0]) / "slices"
    return Path(env.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "skippy" / "slices"


@attrs.frozen
class Offer:
    """What this host has of a slice: all of it (held), or the first `received` bytes of a transfer."""

    held: bool
    received: int
    replaced: bool = False  # a held copy did not match its sha256: deleted, to be sent again

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            digest.update(block)
    return digest.hexdigest()


class SliceStore:
    """One directory of slices. Methods that read or hash whole files are blocking: run them in a thread."""

    def __init__(self, directory: Path):
        self.dir = directory
        self._verified: dict[str, tuple[int, int]] = {}  # sha256 → (size, mtime_ns) of the file last hashed

    def path(self, sha256: str) -> Path:
        return self.dir / f"{_check_sha(sha256)}.gguf"

    def _part(self, sha256: str) -> Path:
        return self.dir / f"{_check_sha(sha256)}.part"

    def _ensure_dir(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SliceStoreError(f"cannot create the slices directory {self.dir}: {exc.strerror or exc}",
                             "failed") from None

    def held(self) -> list[dict]:
        """The complete slices here (not re-hashed): sha256 and size."""
        if not self.dir.is_dir():
            return []
        return [{"sha256": p.stem, "size": p.stat().st_size} for p in sorted(self.dir.glob("*.gguf"))
                if _SHA256_RE.match(p.stem)]

    def disk_free(self) -> int:
        probe = self.dir if self.dir.exists() else next((p for p in self.dir.parents if p.exists()), Path("/"))
        return shutil.disk_usage(probe).free

    def is_held(self, sha256: str) -> bool:
        """Whether the slice is here, whole and matching its sha256 (hashed unless known unchanged)."""
        path = self.path(sha256)
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        if self._verified.get(sha256) == (st.st_size, st.st_mtime_ns):
            return True
        if _sha256_of(path) != sha256:
            return False
        self._verified[sha256] = (st.st_size, st.st_mtime_ns)
        return True

    def offer(self, sha256: str, size: int) -> Offer:
        """Before a transfer: held (nothing to send), or how many bytes of it already arrived."""
        if size < 0:
            raise SliceStoreError(f"size must be at least 0, got {size}")
        path = self.path(sha256)
        replaced = False
        if path.exists():
            if self.is_held(sha256):
                return Offer(held=True, received=path.stat().st_size)
            log.warning("deploy: slice %s no longer matches its sha256 (a damaged copy): deleting it to receive "
                        "it again", path)
            path.unlink(missing_ok=True)
            self._verified.pop(sha256, None)
            replaced = True
        self._ensure_dir()
        part = self._part(sha256)
        received = part.stat().st_size if part.exists() else 0
        if received > size:  # a part longer than the slice is not a prefix of it
            part.unlink()
            received = 0
        free = self.disk_free()
        if size - received > free:
            raise SliceStoreError(f"not enough disk space in {self.dir}: the slice needs {_mib(size - received)} "
                             f"more, {_mib(free)} free", "unavailable")
        return Offer(held=False, received=received, replaced=replaced)

    def write(self, sha256: str, offset: int, data: bytes) -> int:
        """Append one chunk at `offset`, which must be where the received bytes end; the bytes received now."""
        if len(data) > CHUNK_MAX:
            raise SliceStoreError(f"a chunk carries {CHUNK_MAX} bytes at most, got {len(data)}")
        part = self._part(sha256)
        if not part.exists() and offset == 0:
            self._ensure_dir()
        try:
            fd = os.open(part, os.O_WRONLY | (os.O_CREAT if offset == 0 else 0), 0o600)
        except FileNotFoundError:
            raise SliceStoreError(f"no transfer of slice {sha256[:12]} under way: offer it first",
                                  "not_found") from None
        try:
            end = os.fstat(fd).st_size
            if offset != end:
                raise SliceStoreError(f"chunk at byte {offset} of slice {sha256[:12]}, but {end} bytes have arrived: "
                                 "chunks must come in order (offer the slice again to resume)", "conflict")
            os.pwrite(fd, data, offset)
        except OSError as exc:
            raise SliceStoreError(f"cannot write slice {sha256[:12]}: {exc.strerror or exc}", "failed") from None
        finally:
            os.close(fd)
        return offset + len(data)

    def commit(self, sha256: str, size: int) -> None:
        """Every byte has arrived: check the whole against its sha256 and keep it. A mismatch deletes what
        arrived (SliceStoreError, code "corrupt"): the sender starts over."""
        part = self._part(sha256)
        try:
            received = part.stat().st_size
        except FileNotFoundError:
            raise SliceStoreError(f"no transfer of slice {sha256[:12]} under way", "not_found") from None
        if received != size:
            raise SliceStoreError(f"slice {sha256[:12]}: {received} of {size} bytes arrived", "conflict")
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        got = _sha256_of(part)
        if got != sha256:
            part.unlink(missing_ok=True)
            log.warning("deploy: slice %s arrived damaged (its bytes hash to %s): deleted, to be sent again",
                        sha256[:12], got[:12])
            raise SliceStoreError(f"slice {sha256[:12]} arrived damaged (sha256 {got[:12]}…): deleted, send it again",
                             "corrupt")
        path = self.path(sha256)
        os.replace(part, path)
        st = path.stat()
        self._verified[sha256] = (st.st_size, st.st_mtime_ns)
        log.info("deploy: received slice %s (%s)", path.name, _mib(size))


def _check_sha(sha256: str) -> str:
    if not isinstance(sha256, str) or not _SHA256_RE.match(sha256):
        raise SliceStoreError(f"not a sha256 (64 lowercase hex digits): {sha256!r}")
    return sha256


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
