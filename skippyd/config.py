"""skippyd's configuration file, ``skippyd.toml`` (tomllib → attrs classes); flags override it.

The file is found by, in order: ``--config FILE``; ``$CONFIGURATION_DIRECTORY/skippyd.toml``
(systemd's ``ConfigurationDirectory=``); ``/etc/skippy/skippyd.toml``. No file at all
means the built-in defaults. Every key has the name of the flag that overrides it
(``runtime.reply_timeout`` ↔ ``--reply-timeout``); see skippyd.toml(5).

Unknown keys and bad values are errors, reported with the file and the key
(``/etc/skippy/skippyd.toml: runtime.lanes: must be at least 1, got 0``).
Relative paths in the file are relative to the file's directory.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any, Iterator, Optional

import attrs

from skippyd.control.messages import Invalid, converter, structure_errors

CONFIG_NAME = "skippyd.toml"
SYSTEM_CONFIG_DIR = Path("/etc/skippy")
LOG_LEVELS = ("debug", "info", "warning", "error")
TELEMETRY = ("off", "summary", "debug")
DEFAULT_CONTROL = "127.0.0.1:7390"


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


# ---------------------------------------------------------------- sections
@attrs.frozen
class DaemonSection:
    log_level: str = attrs.field(default="info", validator=_one_of(LOG_LEVELS))
    drain_grace: float = attrs.field(default=30.0, validator=_at_least(0))  # seconds
    receipts: Optional[Path] = None
    telemetry: str = attrs.field(default="off", validator=_one_of(TELEMETRY))


@attrs.frozen
class PipelineSection:
    topology: Optional[Path] = None
    stage: Any = attrs.field(default=None, validator=_stage_value)  # an index, or "all"
    model: Optional[Path] = None


@attrs.frozen
class RuntimeSection:
    lanes: int = attrs.field(default=4, validator=_at_least(1))
    ctx: int = attrs.field(default=4096, validator=_at_least(16))
    threads: int = attrs.field(default=0, validator=_at_least(0))  # 0: automatic (see skippyd --help)
    # ggml thread pool: workers poll this long (0-100) then sleep; -1: llama.cpp's per-graph threads
    thread_poll: int = attrs.field(default=0, validator=_in_range(-1, 100))
    # idle-class threads spin this long after each compute so the next starts on warm cores; 0: off
    keep_warm_ms: float = attrs.field(default=0.0, validator=_between(0, 10_000))
    # skippy stages on one host take turns at the cores; auto: unless a stage has one thread
    compute_lock: str = attrs.field(default="auto", validator=_one_of(("auto", "on", "off")))
    # with several threads: fewer while that is much faster (other programs on the cores; ThreadChooser)
    adapt_threads: str = attrs.field(default="on", validator=_one_of(("on", "off")))
    # llama.cpp's flash attention; off: on this CPU build it halves decode at a few hundred tokens of context
    flash_attn: str = attrs.field(default="off", validator=_one_of(("off", "on", "auto")))
    # sessions decoding at once kept in this many groups, one in flight per stage; 0: one per host
    decode_groups: int = attrs.field(default=0, validator=_at_least(0))
    batch: int = attrs.field(default=512, validator=_at_least(1))
    prefill_chunk: int = attrs.field(default=256, validator=_at_least(1))
    credit: int = attrs.field(default=2, validator=_at_least(1))
    reply_timeout: float = attrs.field(default=30.0, validator=_at_least(0.1))
    direct_return: bool = True  # 3+ stages: predictions go from the final stage straight to the head
    queue_timeout: float = attrs.field(default=30.0, validator=_at_least(0))  # the head: wait for a slot
    resume: bool = False  # the head: replay a generation a stage failure interrupted, once it is back
    resume_window: float = attrs.field(default=30.0, validator=_at_least(0))  # ... waiting this long


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
    listen: Optional[str] = attrs.field(default=None, validator=_hostport)
    # who may open a lane to this stage: addresses, networks, host names, or "any"; None: the host the
    # topology names for the previous stage
    upstream_allow: Optional[list[str]] = attrs.field(default=None, validator=_allow_list)
    link_secret_file: Optional[Path] = None  # a shared secret every stage link must present (see skippyd(8))
    frame_timeout: float = attrs.field(default=5.0, validator=_at_least(0.1))  # a started frame's deadline, s
    link_delay_ms: float = attrs.field(default=0.0, validator=_at_least(0))  # link conditioning
    link_mbps: float = attrs.field(default=0.0, validator=_at_least(0))  # 0: no cap


@attrs.frozen
class ControlSection:
    enabled: bool = True
    listen: str = attrs.field(default=DEFAULT_CONTROL, validator=_hostport)
    token_file: Optional[Path] = None


@attrs.frozen
class OpenAISection:
    listen: Optional[str] = attrs.field(default=None, validator=_hostport)
    model_id: Optional[str] = None  # default: the GGUF file name without .gguf


@attrs.frozen
class Config:
    daemon: DaemonSection = attrs.field(factory=DaemonSection)
    pipeline: PipelineSection = attrs.field(factory=PipelineSection)
    runtime: RuntimeSection = attrs.field(factory=RuntimeSection)
    stage: StageSection = attrs.field(factory=StageSection)
    control: ControlSection = attrs.field(factory=ControlSection)
    openai: OpenAISection = attrs.field(factory=OpenAISection)

    def items(self) -> Iterator[tuple[str, Any]]:
        """("section.key", value) for every setting."""
        for section in attrs.fields(Config):
            for field in attrs.fields(type(getattr(self, section.name))):
                yield f"{section.name}.{field.name}", getattr(getattr(self, section.name), field.name)


# Settings SIGHUP may change in a running daemon; everything else needs a restart.
RELOADABLE = ("daemon.log_level", "daemon.drain_grace")

# argparse dest → config key. A flag given on the command line wins over the file.
FLAG_KEYS = {
    "topology": "pipeline.topology",
    "stage": "pipeline.stage",
    "model": "pipeline.model",
    "lanes": "runtime.lanes",
    "ctx": "runtime.ctx",
    "threads": "runtime.threads",
    "thread_poll": "runtime.thread_poll",
    "keep_warm_ms": "runtime.keep_warm_ms",
    "compute_lock": "runtime.compute_lock",
    "adapt_threads": "runtime.adapt_threads",
    "flash_attn": "runtime.flash_attn",
    "decode_groups": "runtime.decode_groups",
    "batch": "runtime.batch",
    "prefill_chunk": "runtime.prefill_chunk",
    "credit": "runtime.credit",
    "reply_timeout": "runtime.reply_timeout",
    "direct_return": "runtime.direct_return",
    "queue_timeout": "runtime.queue_timeout",
    "resume": "runtime.resume",
    "resume_window": "runtime.resume_window",
    "listen": "stage.listen",
    "upstream_allow": "stage.upstream_allow",
    "link_secret_file": "stage.link_secret_file",
    "frame_timeout": "stage.frame_timeout",
    "link_delay_ms": "stage.link_delay_ms",
    "link_mbps": "stage.link_mbps",
    "control": "control.listen",
    "control_token_file": "control.token_file",
    "openai": "openai.listen",
    "model_id": "openai.model_id",
    "telemetry": "daemon.telemetry",
    "receipts": "daemon.receipts",
    "log_level": "daemon.log_level",
    "drain_grace": "daemon.drain_grace",
}


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
        return Config()
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


def _check_flags(flags: dict[str, Any]) -> None:
    """Numeric flags get the same range checks as the file's keys (e.g. --thread-poll 200 is refused)."""
    raw: dict[str, dict[str, Any]] = {}
    for key, value in flags.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # the others are checked by the flag's type or where they are used
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    flag_of = {key: "--" + dest.replace("_", "-") for dest, key in FLAG_KEYS.items()}
    problems = _value_problems(raw, set())
    if problems:
        raise ConfigError(None, [(f"{flag_of.get(key, key)}", why) for key, why in problems])


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set on the command line (argparse defaults are None for every mapped flag)."""
    given = {key: getattr(args, dest) for dest, key in FLAG_KEYS.items() if getattr(args, dest, None) is not None}
    if getattr(args, "no_control", False):
        given["control.enabled"] = False
    return given


def apply(args: argparse.Namespace, config: Config, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill every flag that was not given from `config`; returns a new namespace (the daemon's settings)."""
    types = {action.dest: action.type for action in parser._actions}
    out = argparse.Namespace(**vars(args))
    # --topology or --model on the command line replaces what to run, not just one key of it
    source_flag = getattr(args, "topology", None) is not None or getattr(args, "model", None) is not None
    for dest, key in FLAG_KEYS.items():
        if not hasattr(args, dest) or getattr(args, dest) is not None:
            continue
        if source_flag and key in ("pipeline.topology", "pipeline.model"):
            continue
        value = get(config, key)
        convert = types.get(dest)
        if isinstance(value, str) and callable(convert) and convert is not str:
            value = convert(value)  # "HOST:PORT" strings become what the flag's type makes of them
        setattr(out, dest, value)
    if getattr(out, "stage", None) is not None:
        out.stage = str(out.stage)
    out.no_control = bool(getattr(args, "no_control", False)) or not config.control.enabled
    return out


def changed_keys(old: Config, new: Config) -> list[str]:
    before = dict(old.items())
    return [key for key, value in new.items() if before[key] != value]


@attrs.define
class Settings:
    """Where the daemon's settings came from: the file read, the flags given, and the result."""

    path: Path | None  # the file read (None: built-in defaults)
    file: Config  # what the file says (defaults filled in)
    flags: dict[str, Any]  # config keys given on the command line
    args: argparse.Namespace  # effective settings, one attribute per flag
    parser: argparse.ArgumentParser

    @classmethod
    def load(cls, args: argparse.Namespace, parser: argparse.ArgumentParser,
             environ: dict[str, str] | None = None) -> Settings:
        path = find_config(getattr(args, "config", None), environ)
        file = load(path)
        flags = given_flags(args)
        _check_flags(flags)
        return cls(path, file, flags, apply(args, file, parser), parser)

    def source(self, key: str) -> str:
        if key in self.flags:
            return "flag"
        if self.path is not None and get(self.file, key) != get(Config(), key):
            return "file"
        return "default"

    def effective(self) -> dict[str, Any]:
        """Every "section.key" with the value in force (flags over file over defaults)."""
        values = dict(self.file.items())
        values.update(self.flags)
        return values

    def reload(self) -> Reload:
        """Re-read the file (SIGHUP). Applies the reloadable keys not pinned by a flag to `args`.

        Raises ConfigError (and changes nothing) if the file is now invalid.
        """
        new = load(self.path)
        changed = changed_keys(self.file, new)
        result = Reload(path=self.path)
        for key in changed:
            old_value, new_value = get(self.file, key), get(new, key)
            if key in self.flags:
                result.pinned.append(key)
            elif key in RELOADABLE:
                dest = next(d for d, k in FLAG_KEYS.items() if k == key)
                setattr(self.args, dest, new_value)
                result.applied[key] = (old_value, new_value)
            else:
                result.restart.append(key)
        self.file = new
        return result


@attrs.define
class Reload:
    """What a SIGHUP did."""

    path: Path | None
    applied: dict[str, tuple[Any, Any]] = attrs.field(factory=dict)  # key → (old, new), now in force
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
    if isinstance(value, tuple) and len(value) == 2:  # a parsed HOST:PORT
        host = f"[{value[0]}]" if ":" in str(value[0]) else value[0]
        return f'"{host}:{value[1]}"'
    import json

    return json.dumps(str(value))
