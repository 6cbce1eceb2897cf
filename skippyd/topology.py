"""Topology: which stage runs which layers of which model, and where.

A split writes `topology.toml` beside its stage files; every daemon of a
pipeline reads the same file to find its own stage file and its neighbours'
addresses. The format, with stage files relative to the topology file:

    version = 1
    model_name = "SmolLM2-135M-Instruct.Q4_1"
    source_sha256 = "b179c952..."
    architecture = "llama"
    n_layer = 30
    n_embd = 576
    n_vocab = 49152

    [[stages]]
    index = 0
    file = "stage-0.gguf"
    sha256 = "..."
    layer_start = 0
    layer_end = 15
    host = "127.0.0.1"
    port = 7400
    output = "hidden"
    mmproj = "mmproj.gguf"              # stage 0 only, optional: the head's
    mmproj_sha256 = "..."               # multimodal projector (and its sha256)

Unknown keys and bad values are errors that name the file and the key:
a typo in a topology must not silently fall back to a default.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import tempfile
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import attrs

TOPOLOGY_VERSION = 1
DEFAULT_HOST = "127.0.0.1"
DEFAULT_BASE_PORT = 7400

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_OUTPUTS = ("hidden", "logits")


class TopologyError(ValueError):
    """A topology file or address list is invalid; the message names the file and key."""


@attrs.frozen
class StageSpec:
    """One stage: a slice file holding layers [layer_start, layer_end) and its address."""

    index: int
    file: Path
    sha256: str
    layer_start: int
    layer_end: int
    host: str
    port: int
    output: Literal["hidden", "logits"]
    # the head's multimodal projector (stage 0 only): images in prompts; its sha256 when deploy sent it
    mmproj: Path | None = None
    mmproj_sha256: str | None = None

    @property
    def n_layer(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


@attrs.frozen
class Topology:
    """A model cut into contiguous stages that together cover layers [0, n_layer)."""

    model_name: str
    source_sha256: str
    n_layer: int
    n_embd: int
    n_vocab: int
    architecture: str
    stages: tuple[StageSpec, ...] = attrs.field(converter=tuple)

    def stage(self, k: int) -> StageSpec:
        """The stage with index `k`."""
        if not 0 <= k < len(self.stages):
            raise TopologyError(f"no stage {k}: the topology has {len(self.stages)} stages (0..{len(self.stages) - 1})")
        return self.stages[k]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.layer_start, s.layer_end) for s in self.stages]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly data (paths as strings)."""
        data = attrs.asdict(self, recurse=False)
        data["stages"] = [{**attrs.asdict(s), "file": str(s.file),
                           "mmproj": None if s.mmproj is None else str(s.mmproj)} for s in self.stages]
        return data

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Topology:
        """Read a topology file; stage files are resolved relative to its directory."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise TopologyError(f"{path}: no such file") from None
        except OSError as exc:
            raise TopologyError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise TopologyError(f"{path}: invalid TOML: {exc}") from None
        return _from_toml(data, path)

    def dump(self, path: str | os.PathLike[str]) -> None:
        """Write the topology as TOML, atomically (temp file, then rename)."""
        path = Path(path)
        text = self.to_toml(base_dir=path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp creates 0600; every daemon reads this file
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def to_toml(self, base_dir: Path | None = None) -> str:
        """The TOML text; stage files under `base_dir` are written relative to it."""
        lines = [
            "# skippy pipeline topology (written by `skippyctl model split`)",
            f"version = {TOPOLOGY_VERSION}",
            f"model_name = {_toml_str(self.model_name)}",
            f"source_sha256 = {_toml_str(self.source_sha256)}",
            f"architecture = {_toml_str(self.architecture)}",
            f"n_layer = {self.n_layer}",
            f"n_embd = {self.n_embd}",
            f"n_vocab = {self.n_vocab}",
        ]
        for s in self.stages:
            lines += [
                "",
                "[[stages]]",
                f"index = {s.index}",
                f"file = {_toml_str(_relative(s.file, base_dir))}",
                f"sha256 = {_toml_str(s.sha256)}",
                f"layer_start = {s.layer_start}",
                f"layer_end = {s.layer_end}",
                f"host = {_toml_str(s.host)}",
                f"port = {s.port}",
                f"output = {_toml_str(s.output)}",
            ]
            if s.mmproj is not None:
                lines.append(f"mmproj = {_toml_str(_relative(s.mmproj, base_dir))}")
            if s.mmproj_sha256 is not None:
                lines.append(f"mmproj_sha256 = {_toml_str(s.mmproj_sha256)}")
        return "\n".join(lines) + "\n"


def _toml_str(value: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX ...) are all valid TOML basic-string escapes.
    return json.dumps(value, ensure_ascii=False)


def _relative(file: Path, base_dir: Path | None) -> str:
    if base_dir is not None:
        try:
            return file.resolve().relative_to(base_dir.resolve()).as_posix()
        except ValueError:
            pass
    return str(file)


# --- addresses -------------------------------------------------------------


def parse_address(text: str) -> tuple[str, int]:
    """Parse "HOST:PORT" (or "[IPv6]:PORT") into (host, port)."""
    text = text.strip()
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]\s]+):(\d+)", text)
    if not m:
        raise TopologyError(f"bad address {text!r}: expected HOST:PORT, e.g. 10.0.0.2:7400 or [::1]:7400")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 1 <= port <= 65535:
        raise TopologyError(f"bad address {text!r}: port must be 1-65535")
    return host, port


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


ALLOW_ANY = ("any", "*")
_HOSTNAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?"
                          r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*\.?$")


def parse_allow_entry(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | str | None:
    """One entry of an upstream allow-list: an address or network (``10.0.0.5``, ``10.0.0.0/24``,
    ``::1``), a host name (``str``, resolved when a peer connects), or ``any`` / ``*`` (None: every
    address). Raises TopologyError for anything else."""
    text = str(text).strip()
    if text.lower() in ALLOW_ANY:
        return None
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    if _HOSTNAME_RE.match(text) and not text.replace(".", "").isdigit():
        return text.lower().rstrip(".")
    raise TopologyError(f"bad allow-list entry {text!r}: expected an address, a network (10.0.0.0/24), "
                        f"a host name, or \"any\"")


def stage_addresses(
    n_stages: int,
    hosts: Sequence[str] | None = None,
    *,
    host: str = DEFAULT_HOST,
    base_port: int = DEFAULT_BASE_PORT,
) -> list[tuple[str, int]]:
    """One (host, port) per stage: the given "HOST:PORT" list, or host with base_port+K."""
    if hosts is None:
        if not 1 <= base_port <= 65535 - (n_stages - 1):
            raise TopologyError(f"base port {base_port} leaves no room for {n_stages} stages")
        return [(host, base_port + k) for k in range(n_stages)]
    if len(hosts) != n_stages:
        raise TopologyError(f"{len(hosts)} addresses given for {n_stages} stages; give exactly one HOST:PORT per stage")
    addresses = [parse_address(h) for h in hosts]
    if len(set(addresses)) != len(addresses):
        raise TopologyError("two stages have the same HOST:PORT")
    return addresses


# --- loading ---------------------------------------------------------------

_TOP_KEYS = {"version", "model_name", "source_sha256", "architecture", "n_layer", "n_embd", "n_vocab", "stages"}
_STAGE_KEYS = {"index", "file", "sha256", "layer_start", "layer_end", "host", "port", "output", "mmproj",
               "mmproj_sha256"}


class _Fields:
    """Typed access to one TOML table, with errors that name the file and key."""

    def __init__(self, path: Path, table: Any, where: str, allowed: set[str]):
        self.path, self.where = path, where
        if not isinstance(table, dict):
            self.fail(where.rstrip("."), "expected a table")
        unknown = sorted(set(table) - allowed)
        if unknown:
            self.fail(unknown[0], f"unknown key (allowed: {', '.join(sorted(allowed))})")
        self.table = table

    def fail(self, key: str, message: str) -> NoReturn:
        raise TopologyError(f"{self.path}: {self.where}{key}: {message}")

    def get(self, key: str, default: Any = attrs.NOTHING) -> Any:
        if key not in self.table:
            if default is not attrs.NOTHING:
                return default
            self.fail(key, "missing")
        return self.table[key]

    def integer(self, key: str, minimum: int = 0, maximum: int | None = None, default: Any = attrs.NOTHING) -> int:
        value = self.get(key, default)
        # bool is an int subclass in Python, but `true` is not a layer number.
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if not is_int or value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"{minimum}-{maximum}"
            self.fail(key, f"expected an integer {bounds}, got {value!r}")
        return value

    def string(self, key: str, choices: Sequence[str] | None = None, pattern: re.Pattern[str] | None = None) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value:
            self.fail(key, f"expected a non-empty string, got {value!r}")
        if choices is not None and value not in choices:
            self.fail(key, f"expected one of {', '.join(choices)}, got {value!r}")
        if pattern is not None and not pattern.match(value):
            self.fail(key, f"got {value!r}, expected {pattern.pattern}")
        return value


def _from_toml(data: dict[str, Any], path: Path) -> Topology:
    top = _Fields(path, data, "", _TOP_KEYS)
    version = top.integer("version", minimum=1, default=TOPOLOGY_VERSION)
    if version != TOPOLOGY_VERSION:
        top.fail("version", f"unsupported topology version {version} (this skippy reads version {TOPOLOGY_VERSION})")
    n_layer = top.integer("n_layer", minimum=1)
    raw_stages = top.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        top.fail("stages", "expected at least one [[stages]] table")
    base = path.resolve().parent  # stage files follow the topology file, whatever the cwd
    stages = []
    for i, raw in enumerate(raw_stages):
        f = _Fields(path, raw, f"stages[{i}].", _STAGE_KEYS)
        index = f.integer("index")
        if index != i:
            f.fail("index", f"expected {i} (stages must be listed in order), got {index}")
        start = f.integer("layer_start")
        end = f.integer("layer_end", minimum=1, maximum=n_layer)
        if end <= start:
            f.fail("layer_end", f"{end} is not after layer_start {start}")
        expected_start = stages[-1].layer_end if stages else 0
        if start != expected_start:
            f.fail("layer_start", f"expected {expected_start} (stages must be contiguous from layer 0), got {start}")
        output = f.string("output", choices=_OUTPUTS)
        is_final = i == len(raw_stages) - 1
        if output != ("logits" if is_final else "hidden"):
            f.fail("output", f"the {'final' if is_final else 'non-final'} stage must output "
                             f"{'logits' if is_final else 'hidden'}, got {output!r}")
        mmproj = mmproj_sha256 = None
        if "mmproj" in raw or "mmproj_sha256" in raw:
            if i != 0:
                f.fail("mmproj", "only stage 0 (the head) takes a multimodal projector")
            mmproj = base / f.string("mmproj")
            if "mmproj_sha256" in raw:
                mmproj_sha256 = f.string("mmproj_sha256", pattern=_SHA256_RE)
        stages.append(StageSpec(
            index=index,
            file=base / f.string("file"),
            sha256=f.string("sha256", pattern=_SHA256_RE),
            layer_start=start,
            layer_end=end,
            host=f.string("host"),
            port=f.integer("port", minimum=1, maximum=65535),
            output=output,
            mmproj=mmproj,
            mmproj_sha256=mmproj_sha256,
        ))
    if stages[-1].layer_end != n_layer:
        raise TopologyError(f"{path}: stages cover layers 0..{stages[-1].layer_end} but n_layer is {n_layer}")
    return Topology(
        model_name=top.string("model_name"),
        source_sha256=top.string("source_sha256", pattern=_SHA256_RE),
        n_layer=n_layer,
        n_embd=top.integer("n_embd", minimum=1),
        n_vocab=top.integer("n_vocab", minimum=1),
        architecture=top.string("architecture"),
        stages=stages,
    )
