"""skippyd's settings: every key of ``skippyd.toml``, its default and its check, in one place.

The file is found by, in order: ``--config FILE``; ``$CONFIGURATION_DIRECTORY/skippyd.toml``
(systemd's ``ConfigurationDirectory=``); ``/etc/skippy/skippyd.toml``. No file at all
means the built-in defaults. A few keys also have a flag of the same name, which
overrides the file (``runtime.lanes`` ↔ ``--lanes``, see skippyd.cli); the tuning
keys are set in the file only. See skippyd.toml(5).

Unknown keys and bad values are errors, reported with the file and the key
(``/etc/skippy/skippyd.toml: runtime.lanes: must be at least 1, got 0``).
Relative paths in the file are relative to the file's directory.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from skippyd.convert import Invalid, converter, structure_errors
from skippyd.wire.messages import ACTIVATION_WIRES
from skippyd.wire.stream import DEFAULT_FRAME_TIMEOUT, DEFAULT_PEER_TIMEOUT

CONFIG_NAME = "skippyd.toml"
SYSTEM_CONFIG_DIR = Path("/etc/skippy")
LOG_LEVELS = ("debug", "info", "warning", "error")
TELEMETRY = ("off", "summary", "debug")
DEFAULT_CONTROL = "127.0.0.1:7390"
SPECULATE_MODES = ("off", "ngram", "on")  # on: ngram, the one proposer there is


class ConfigError(Exception):
    """The configuration cannot be used; one line per problem, each naming the file and the key."""

    def __init__(self, path: Path | None, problems: list[tuple[str, str]]):
        self.path = path
        self.problems = problems
        where = f"{path}: " if path else ""
        super().__init__("\n".join(f"{where}{key}: {why}" if key else f"{where}{why}" for key, why in problems))


# ---------------------------------------------------------------- validators
def _at_least(low: float):
    def check(_inst, attribute, value) -> None:
        if value is not None and value < low:
            raise Invalid(f"must be at least {low:g}, got {value:g}", attribute.name)
    return check


def _between(low: float, high: float):
    def check(_inst, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise Invalid(f"must be a number from {low:g} to {high:g}, got {value!r}", attribute.name)
    return check


def _in_range(low: int, high: int):
    def check(_inst, attribute, value) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise Invalid(f"must be an integer from {low} to {high}, got {value!r}", attribute.name)
    return check


def _one_of(choices: tuple[str, ...]):
    def check(_inst, attribute, value) -> None:
        if value not in choices:
            raise Invalid(f"must be one of {', '.join(choices)}; got {value!r}", attribute.name)
    return check


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:7390`` for IPv6) → (host, port); an empty host means 127.0.0.1."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or "127.0.0.1", int(port)


def _hostport(_inst, attribute, value) -> None:
    if value is None:
        return
    try:
        parse_hostport(value)
    except ValueError as exc:
        raise Invalid(str(exc), attribute.name) from None


def _stage_value(_inst, attribute, value) -> None:
    if value is None or value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise Invalid(f"must be a stage index (0, 1, ...) or \"all\", got {value!r}", attribute.name)


def _gpu_layers_value(_inst, attribute, value) -> None:
    if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return
    raise Invalid(f"must be \"all\" or a number of layers (0: none), got {value!r}", attribute.name)


# ---------------------------------------------------------------- sections
# Each field's default is the daemon's default (StageConfig and the others read theirs from DEFAULTS).
@attrs.frozen
class DaemonSection:
    log_level: str = attrs.field(default="info", validator=_one_of(LOG_LEVELS))
    drain_grace: float = attrs.field(default=30.0, validator=_at_least(0))  # seconds
    receipts: Path | None = None
    telemetry: str = attrs.field(default="off", validator=_one_of(TELEMETRY))


@attrs.frozen
class PipelineSection:
    topology: Path | None = None
    stage: Any = attrs.field(default=None, validator=_stage_value)  # an index, or "all"
    model: Path | None = None
    # where slices sent by `skippyctl deploy` are kept; None: $STATE_DIRECTORY/slices, else
    # ~/.local/state/skippy/slices
    slices_dir: Path | None = None
    # a Jinja chat template for chat requests in place of the model's own (a base model has none)
    chat_template_file: Path | None = None
    # the head's multimodal projector (llama.cpp's "mmproj" GGUF of the model's vision encoder): images in
    # prompts; None: the topology's stage 0 mmproj, if any
    mmproj: Path | None = None


@attrs.frozen
class RuntimeSection:
    lanes: int = attrs.field(default=4, validator=_at_least(1))
    ctx: int = attrs.field(default=4096, validator=_at_least(16))
    threads: int = attrs.field(default=0, validator=_at_least(0))  # 0: every core this daemon may use
    # the last N of each stage's own layers computed on the GPU (a build with a GPU backend), "all": every one
    # and the output head; 0: the CPU only
    gpu_layers: Any = attrs.field(default=0, validator=_gpu_layers_value)
    # ggml thread pool: workers poll this long (0-100) then sleep; -1: llama.cpp's per-graph threads
    thread_poll: int = attrs.field(default=0, validator=_in_range(-1, 100))
    # idle-class threads spin this long after each compute so the next starts on warm cores; 0: off
    keep_warm_ms: float = attrs.field(default=0.0, validator=_between(0, 10_000))
    # skippy stages on one host take turns at the cores; auto: unless a stage has one thread
    compute_lock: str = attrs.field(default="auto", validator=_one_of(("auto", "on", "off")))
    # with several threads: fewer while that is much faster (other programs on the cores)
    adapt_threads: str = attrs.field(default="on", validator=_one_of(("on", "off")))
    # llama.cpp's flash attention; off: on the CPU build it slows decoding once a session holds some context
    flash_attn: str = attrs.field(default="off", validator=_one_of(("off", "on", "auto")))
    # sessions decoding at once kept in this many groups, one in flight per stage; 0: one per machine
    decode_groups: int = attrs.field(default=0, validator=_at_least(0))
    batch: int = attrs.field(default=512, validator=_at_least(1))
    prefill_chunk: int = attrs.field(default=256, validator=_at_least(1))
    credit: int = attrs.field(default=2, validator=_at_least(1))
    reply_timeout: float = attrs.field(default=30.0, validator=_at_least(0.1))
    # a stage link whose peer host has been silent this long (s) is closed and its sessions released; the
    # kernel probes a link after a second of quiet, so this is at least 2
    peer_timeout: float = attrs.field(default=DEFAULT_PEER_TIMEOUT, validator=_at_least(2))
    direct_return: bool = True  # 3+ stages: predictions go from the final stage straight to the head
    # how activations cross a stage link: auto: f32 (a split exact) unless the link, timed when it opens, is slow
    # enough that f16 (half the bytes) saves a real share of the time (skippyd/stage/link_choice.py); f16: half
    # floats wherever the other end takes them; f32: this daemon's links at float32 both ways
    activation_wire: str = attrs.field(default="auto", validator=_one_of(ACTIVATION_WIRES))
    queue_timeout: float = attrs.field(default=30.0, validator=_at_least(0))  # the head: wait for a slot
    resume: bool = False  # the head: replay a generation a stage failure interrupted, once it is back
    resume_window: float = attrs.field(default=30.0, validator=_at_least(0))  # ... waiting this long
    # the most memory (MiB) a stage's prefix cache may hold: the KV of prompts it has computed; 0: no cache
    prefix_cache_mb: int = attrs.field(default=512, validator=_at_least(0))
    # where each stage keeps its prefix cache's disk tier (DIR/stage-K: entries evicted from memory, and those
    # held at a clean stop); None: $STATE_DIRECTORY/prefix-cache under systemd, else no disk tier
    prefix_cache_dir: Path | None = None
    # the most disk (MiB) each stage's disk tier may use; 0: no disk tier
    prefix_cache_disk_mb: int = attrs.field(default=4096, validator=_at_least(0))
    # the head: draft tokens from the session's own context and verify them in windows (speculative decoding)
    # ngram: drafts from n-grams of the session's own context, windows sized and gated by what they measure
    # (on: the same); off: token by token
    speculate: str = attrs.field(default="ngram", validator=_one_of(SPECULATE_MODES))
    speculate_max_draft: int = attrs.field(default=16, validator=_in_range(1, 16))  # drafts in one window at most
    # verify windows in flight at most (the next sent before the last is answered, over a long round trip);
    # 1: each answered before the next
    speculate_in_flight: int = attrs.field(default=4, validator=_in_range(1, 4))
    # the most memory (MiB) skippy may use on this host, as reported to a deployment's planner; 0: what the
    # host (or its cgroup) has available
    memory_limit_mb: int = attrs.field(default=0, validator=_at_least(0))
    # the head with a projector: the largest image a request may send (MiB, encoded), and the most pixels its
    # header may claim (checked before it is decoded)
    image_max_mb: int = attrs.field(default=20, validator=_in_range(1, 1024))
    image_max_pixels: int = attrs.field(default=1 << 25, validator=_in_range(1, 1 << 31))


def _allow_list(_inst, attribute, value) -> None:
    if value is None:
        return
    from skippyd.topology import TopologyError, parse_allow_entry

    if not value:
        raise Invalid('must name at least one address (or "any")', attribute.name)
    for entry in value:
        try:
            parse_allow_entry(entry)
        except TopologyError as exc:
            raise Invalid(str(exc), attribute.name) from None


@attrs.frozen
class StageSection:
    listen: str | None = attrs.field(default=None, validator=_hostport)
    # who may open a lane to this stage: addresses, networks, host names, or "any"; None: the host the
    # topology names for the previous stage
    upstream_allow: list[str] | None = attrs.field(default=None, validator=_allow_list)
    link_secret_file: Path | None = None  # a shared secret every stage link must present (see skippyd(8))
    # a started frame's deadline, s (plus its size at 1 MiB/s)
    frame_timeout: float = attrs.field(default=DEFAULT_FRAME_TIMEOUT, validator=_at_least(0.1))
    link_delay_ms: float = attrs.field(default=0.0, validator=_at_least(0))  # link conditioning
    link_mbps: float = attrs.field(default=0.0, validator=_at_least(0))  # 0: no cap


@attrs.frozen
class ControlSection:
    enabled: bool = True
    listen: str = attrs.field(default=DEFAULT_CONTROL, validator=_hostport)
    token_file: Path | None = None
    # a message to a client must be sent within this (s), or the client is dropped and its generations end
    message_timeout: float = attrs.field(default=10.0, validator=_at_least(0.1))


@attrs.frozen
class OpenAISection:
    listen: str | None = attrs.field(default=None, validator=_hostport)
    model_id: str | None = None  # default: the GGUF file name without .gguf
    # a file holding the key every /v1/* request (and the console) must present as "Authorization: Bearer KEY"
    api_key_file: Path | None = None
    public_metrics: bool = False  # /metrics without the key (with no key set it is open anyway)


@attrs.frozen
class DeploySection:
    # a host of a supervised deployment (skippyctl deploy) unreachable this long is dropped and the pipeline
    # re-planned over the hosts left, s
    rejoin_grace_s: float = attrs.field(default=10.0, validator=_at_least(0))


@attrs.frozen
class Config:
    daemon: DaemonSection = attrs.field(factory=DaemonSection)
    pipeline: PipelineSection = attrs.field(factory=PipelineSection)
    runtime: RuntimeSection = attrs.field(factory=RuntimeSection)
    stage: StageSection = attrs.field(factory=StageSection)
    control: ControlSection = attrs.field(factory=ControlSection)
    openai: OpenAISection = attrs.field(factory=OpenAISection)
    deploy: DeploySection = attrs.field(factory=DeploySection)

    def items(self) -> Iterator[tuple[str, Any]]:
        """("section.key", value) for every setting."""
        for section in attrs.fields(Config):
            for field in attrs.fields(type(getattr(self, section.name))):
                yield f"{section.name}.{field.name}", getattr(getattr(self, section.name), field.name)


DEFAULTS = Config()

# Settings SIGHUP may change in a running daemon; everything else needs a restart.
RELOADABLE = ("daemon.log_level", "daemon.drain_grace")


# ---------------------------------------------------------------- loading
def find_config(explicit: Path | None, environ: dict[str, str] | None = None) -> Path | None:
    """The file to read: --config, then $CONFIGURATION_DIRECTORY, then /etc/skippy; None if none exists."""
    env = os.environ if environ is None else environ
    if explicit is not None:
        return explicit  # must exist: load() says so if it does not
    for directory in (env.get("CONFIGURATION_DIRECTORY") or "").split(":"):
        if directory and (Path(directory) / CONFIG_NAME).is_file():
            return Path(directory) / CONFIG_NAME
    system = SYSTEM_CONFIG_DIR / CONFIG_NAME
    return system if system.is_file() else None


def load(path: Path | None) -> Config:
    """Read and check `path` (None: the defaults). Raises ConfigError naming the file and every bad key."""
    if path is None:
        return DEFAULTS
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(path, [("", "no such file")]) from None
    except OSError as exc:
        raise ConfigError(path, [("", f"cannot read it: {exc.strerror or exc}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, [("", f"not valid TOML: {exc}")]) from None
    problems: list[tuple[str, str]] = []
    config = None
    with attrs.validators.disabled():  # types first (every bad key at once), values below
        try:
            config = converter.structure(raw, Config)
        except Exception as exc:  # cattrs: every bad key, with its path
            problems = [(key.lstrip("."), why) for key, why in structure_errors(exc, "")]
    problems += _value_problems(raw, {key for key, _ in problems})
    if problems:
        raise ConfigError(path, problems)
    return _relative_to(config, path.parent)


def _value_problems(raw: dict, bad_types: set[str]) -> list[tuple[str, str]]:
    """Run every field's validator on the values whose type was right (all of them, not just the first)."""
    problems = []
    for section in attrs.fields(Config):
        table = raw.get(section.name)
        if not isinstance(table, dict):
            continue
        for field in attrs.fields(type(section.default.factory())):
            key = f"{section.name}.{field.name}"
            if field.name not in table or key in bad_types or field.validator is None:
                continue
            try:
                field.validator(None, field, table[field.name])
            except Invalid as exc:
                problems.append((key, str(exc)))
    return problems


def _relative_to(config: Config, base: Path) -> Config:
    def fix(p: Path | None) -> Path | None:
        return None if p is None or p.is_absolute() else base / p

    changes = {}
    for key, value in config.items():
        if isinstance(value, Path) and not value.is_absolute():
            changes[key] = fix(value)
    return with_values(config, changes)


def with_values(config: Config, values: dict[str, Any]) -> Config:
    """A copy of `config` with some "section.key" values replaced."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return attrs.evolve(config, **{s: attrs.evolve(getattr(config, s), **kv) for s, kv in sections.items()})


def get(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def check_values(values: dict[str, Any]) -> list[tuple[str, str]]:
    """("section.key", why) for each value its key's check refuses (values that are set, of the right type)."""
    raw: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if value is not None:
            section, name = key.split(".")
            raw.setdefault(section, {})[name] = value
    return _value_problems(raw, set())


def changed_keys(old: Config, new: Config) -> list[str]:
    before = dict(old.items())
    return [key for key, value in new.items() if before[key] != value]


@attrs.define
class Settings:
    """Where the daemon's settings came from: the file read and the keys set on the command line."""

    path: Path | None  # the file read (None: built-in defaults)
    file: Config  # what the file says (defaults filled in)
    flags: dict[str, Any] = attrs.field(factory=dict)  # "section.key" values given on the command line

    @classmethod
    def read(cls, flags: dict[str, Any], explicit: Path | None = None,
             environ: dict[str, str] | None = None) -> Settings:
        """The file `explicit` (else the one find_config finds) under `flags`. Raises ConfigError."""
        path = find_config(explicit, environ)
        return cls(path, load(path), dict(flags))

    @property
    def config(self) -> Config:
        """The settings in force at start: flags over the file over the defaults."""
        return with_values(self.file, self.flags)

    def source(self, key: str) -> str:
        if key in self.flags:
            return "flag"
        if self.path is not None and get(self.file, key) != get(DEFAULTS, key):
            return "file"
        return "default"

    def effective(self) -> dict[str, Any]:
        """Every "section.key" with the value in force (flags over file over defaults)."""
        return dict(self.config.items())

    def reload(self) -> Reload:
        """Re-read the file (SIGHUP); sorts what changed into applied (RELOADABLE, not set by a flag), pinned
        by a flag, and needing a restart. Raises ConfigError (and changes nothing) if the file is now invalid.
        """
        new = load(self.path)
        result = Reload(path=self.path)
        for key in changed_keys(self.file, new):
            if key in self.flags:
                result.pinned.append(key)
            elif key in RELOADABLE:
                result.applied[key] = (get(self.file, key), get(new, key))
            else:
                result.restart.append(key)
        self.file = new
        return result


@attrs.define
class Reload:
    """What a SIGHUP did."""

    path: Path | None
    applied: dict[str, tuple[Any, Any]] = attrs.field(factory=dict)  # key → (old, new), to apply now
    restart: list[str] = attrs.field(factory=list)  # changed, but only a restart applies them
    pinned: list[str] = attrs.field(factory=list)  # changed, but a command-line flag overrides the file


def toml_value(value: Any) -> str:
    """A value as TOML would write it (for --check-config)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    import json

    return json.dumps(str(value))
