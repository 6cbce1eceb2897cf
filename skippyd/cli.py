"""skippyd's command line: the flags an operator gives by hand, each overriding a key of skippyd.toml(5).

Tuning knobs (the compute lock, thread polling, batch sizes, link timeouts,
drain grace, receipts, telemetry, ...) are keys of the configuration file
only. Their old flags are refused with the key to set instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from skippyd import config as cfgmod
from skippyd.config import ConfigError, Settings, parse_hostport

# argparse dest → config key. A flag given on the command line wins over the file.
FLAG_KEYS = {
    "topology": "pipeline.topology",
    "stage": "pipeline.stage",
    "model": "pipeline.model",
    "slices_dir": "pipeline.slices_dir",
    "chat_template": "pipeline.chat_template_file",
    "mmproj": "pipeline.mmproj",
    "lanes": "runtime.lanes",
    "ctx": "runtime.ctx",
    "threads": "runtime.threads",
    "gpu_layers": "runtime.gpu_layers",
    "queue_timeout": "runtime.queue_timeout",
    "resume": "runtime.resume",
    "prefix_cache_mb": "runtime.prefix_cache_mb",
    "prefix_cache_dir": "runtime.prefix_cache_dir",
    "prefix_cache_disk_mb": "runtime.prefix_cache_disk_mb",
    "speculate": "runtime.speculate",
    "listen": "stage.listen",
    "upstream_allow": "stage.upstream_allow",
    "link_secret_file": "stage.link_secret_file",
    "control": "control.listen",
    "control_token_file": "control.token_file",
    "openai": "openai.listen",
    "model_id": "openai.model_id",
    "api_key_file": "openai.api_key_file",
    "log_level": "daemon.log_level",
}
NO_CONTROL_KEY = "control.enabled"  # --no-control sets it to false

# Keys set in the configuration file only.
FILE_ONLY = tuple(key for key, _ in cfgmod.DEFAULTS.items() if key not in {*FLAG_KEYS.values(), NO_CONTROL_KEY})


def moved_flags() -> dict[str, str]:
    """The flags that became file-only keys, by the key's name: ``--keep-warm-ms`` → ``runtime.keep_warm_ms``."""
    moved = {"--" + key.split(".")[1].replace("_", "-"): key for key in FILE_ONLY}
    moved["--no-direct-return"] = "runtime.direct_return"
    return moved


class _SetInTheFile(argparse.Action):
    """A flag that is a configuration key now: refused (exit 2), naming the key to set instead."""

    def __init__(self, option_strings, dest, key: str, **_kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.key = key

    def __call__(self, parser, namespace, values, option_string=None):
        section, name = self.key.split(".")
        parser.error(f"{option_string} is set in the configuration file only: {self.key} "
                     f"([{section}] {name} = ..., see skippyd.toml(5))")


def _hostport(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _stage(text: str) -> int | str:
    if text == "all":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a stage index (0, 1, ...) or 'all', got {text!r}")


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text}")
    return value


def _gpu_layers(text: str) -> int | str:
    if text.strip().lower() == "all":
        return "all"
    try:
        return _non_negative_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"give all or a number of layers (0: none), not {text!r}") from None


def _allow_list(text: str) -> list[str]:
    from skippyd.topology import TopologyError, parse_allow_entry

    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise argparse.ArgumentTypeError("give at least one address, or 'any'")
    for entry in entries:
        try:
            parse_allow_entry(entry)
        except TopologyError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def build_parser() -> argparse.ArgumentParser:
    """Every flag that has a config key defaults to None: "not given", so the file's value applies."""
    p = argparse.ArgumentParser(
        prog="skippyd", description="skippy pipeline stage daemon (one per host). See skippyd(8).",
        epilog="Flags override the configuration file. Tuning (compute lock, thread polling, batch sizes, "
               "timeouts, drain grace, receipts, telemetry, ...) is set in the file only: see skippyd.toml(5).")
    p.add_argument("--config", type=Path, default=None, metavar="FILE",
                   help="configuration file (default: $CONFIGURATION_DIRECTORY/skippyd.toml, "
                        "then /etc/skippy/skippyd.toml, if present)")
    p.add_argument("--check-config", action="store_true",
                   help="check the configuration, print the settings in force and exit")
    p.add_argument("--version", action="store_true",
                   help="print the version, the native build's backends and the devices they find, and exit")
    src = p.add_argument_group("what to run")
    src.add_argument("--topology", type=Path, metavar="FILE", help="topology.toml written by `skippyctl model split`")
    src.add_argument("--stage", type=_stage, default=None, metavar="K|all",
                     help="stage index to run, or 'all' (default: all)")
    src.add_argument("--model", type=Path, metavar="FILE", help="run this whole GGUF model as a single stage")
    src.add_argument("--slices-dir", type=Path, metavar="DIR",
                     help="where slices sent by `skippyctl deploy` are kept (default: $STATE_DIRECTORY/slices, "
                          "else ~/.local/state/skippy/slices); with neither --topology nor --model the daemon "
                          "waits to be given a stage")
    src.add_argument("--chat-template", type=Path, metavar="FILE",
                     help="the head: a Jinja chat template for chat requests, in place of the model's own "
                          "(for a base model, which has none)")
    src.add_argument("--mmproj", type=Path, metavar="FILE",
                     help="the head: the model's multimodal projector (llama.cpp's mmproj GGUF), for images in "
                          "prompts (default: the topology's stage 0 mmproj, if any)")
    run = p.add_argument_group("runtime")
    run.add_argument("--lanes", type=int, default=None, metavar="N",
                     help="concurrent sessions per stage (KV sequences, default 4)")
    run.add_argument("--ctx", type=int, default=None, metavar="N", help="context tokens per session (default 4096)")
    run.add_argument("--threads", type=int, default=None, metavar="N",
                     help="compute threads per stage (default: all cores it may use, affinity and cgroup quota; "
                          "with compute_lock = \"off\", those cores / stages of the topology on this host)")
    run.add_argument("--gpu-layers", type=_gpu_layers, default=None, metavar="N|all",
                     help="the last N of each stage's own layers computed on the GPU, or all (with the output "
                          "head); needs a build with a GPU backend (skippyd --version); default 0: the CPU only")
    run.add_argument("--queue-timeout", type=_non_negative, default=None, metavar="SECONDS",
                     help="the head: how long a generation may wait for a free session slot (default 30)")
    run.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                     help="the head: a generation a stage failure interrupts is replayed once the pipeline "
                          "is whole again, instead of failing (default off)")
    run.add_argument("--prefix-cache-mb", type=_non_negative_int, default=None, metavar="N",
                     help="the most memory (MiB) each stage's prefix cache may hold: the KV of prompts it has "
                          "computed, so that a prompt that begins the same computes only the rest; 0: off "
                          "(default 512)")
    run.add_argument("--prefix-cache-dir", type=Path, default=None, metavar="DIR",
                     help="keep each stage's prefix cache on disk too, in DIR/stage-K: the entries memory "
                          "evicts and those it holds at a clean stop, so a restart starts warm (default: "
                          "$STATE_DIRECTORY/prefix-cache under systemd, else none)")
    run.add_argument("--prefix-cache-disk-mb", type=_non_negative_int, default=None, metavar="N",
                     help="the most disk (MiB) each stage's prefix cache may use in --prefix-cache-dir; 0: "
                          "no disk tier (default 4096)")
    run.add_argument("--speculate", choices=cfgmod.SPECULATE_MODES, default=None,
                     help="the head: draft tokens from each session's own context (its prompt and reply) and "
                          "verify several at once in one trip round the pipeline; a session drafts only while "
                          "that pays, and the output is what decoding token by token gives: ngram (default; on "
                          "is the same) or off")
    net = p.add_argument_group("network and security")
    net.add_argument("--listen", type=_hostport, default=None, metavar="HOST:PORT",
                     help="this stage's listener (default: from the topology)")
    net.add_argument("--upstream-allow", type=_allow_list, default=None, metavar="LIST",
                     help="comma-separated addresses, networks (10.0.0.0/24) or host names that may open a "
                          "lane to this stage, or 'any' (default: the previous stage's host in the topology)")
    net.add_argument("--link-secret-file", type=Path, default=None, metavar="FILE",
                     help="a secret shared by every daemon of the pipeline: stage links without it are refused")
    net.add_argument("--control", type=_hostport, default=None, metavar="HOST:PORT",
                     help=f"control websocket (default {cfgmod.DEFAULT_CONTROL})")
    net.add_argument("--control-token-file", type=Path, default=None, metavar="FILE",
                     help="file holding the control token (created 0600 if absent; "
                          "default $STATE_DIRECTORY/control.token or ~/.local/state/skippy/control.token)")
    net.add_argument("--no-control", action="store_true", help="do not serve the control channel")
    api = p.add_argument_group("OpenAI API")
    api.add_argument("--openai", type=_hostport, default=None, metavar="HOST:PORT",
                     help="serve the OpenAI-compatible HTTP API (and /metrics) here; only the head serves it")
    api.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                     help="every /v1/* request (and the web console's views) must present the key in FILE as "
                          "'Authorization: Bearer KEY'; /health stays open")
    api.add_argument("--model-id", default=None, metavar="NAME",
                     help="model name the OpenAI API serves (default: the GGUF file name without .gguf)")
    life = p.add_argument_group("daemon")
    life.add_argument("--log-level", default=None, choices=cfgmod.LOG_LEVELS, help="default info")
    for flag, key in moved_flags().items():
        p.add_argument(flag, action=_SetInTheFile, key=key)
    return p


def given_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set on the command line (argparse defaults are None for every mapped flag)."""
    given = {key: getattr(args, dest) for dest, key in FLAG_KEYS.items() if getattr(args, dest, None) is not None}
    if getattr(args, "no_control", False):
        given[NO_CONTROL_KEY] = False
    if "pipeline.topology" in given or "pipeline.model" in given:
        # --topology or --model replaces what to run, not just one key of it
        given.setdefault("pipeline.topology", None)
        given.setdefault("pipeline.model", None)
    return given


def read_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """The configuration file under the flags of `args`. Raises ConfigError: a bad file names the file and its
    keys; a bad flag value gets the key's own check, named by the flag (``--lanes: must be at least 1``)."""
    flags = given_flags(args)
    settings = Settings.read(flags, getattr(args, "config", None), environ)
    flag_of = {key: "--" + dest.replace("_", "-") for dest, key in FLAG_KEYS.items()}
    problems = cfgmod.check_values(flags)
    if problems:
        raise ConfigError(None, [(flag_of.get(key, key), why) for key, why in problems])
    return settings


def print_version() -> None:
    """--version: skippy's version, the pinned llama.cpp, and what this build computes on."""
    from importlib.metadata import PackageNotFoundError, version

    from skippyd.runtime.llama.devices import describe_build

    try:
        mine = version("skippy")
    except PackageNotFoundError:
        mine = "(not installed)"
    print(f"skippyd {mine}\n{describe_build()}")


def check_config(settings: Settings) -> None:
    """--check-config: the settings in force, as TOML, each with where it came from."""
    print(f"# {settings.path or 'no configuration file: built-in defaults'}")
    section = None
    for key, value in settings.effective().items():
        sec, name = key.split(".")
        if sec != section:
            print(f"{'' if section is None else chr(10)}[{sec}]")
            section = sec
        source = settings.source(key)
        if value is None:
            print(f"# {name} is not set")
        else:
            print(f"{name} = {cfgmod.toml_value(value)}" + (f"  # {source}" if source != "default" else ""))
