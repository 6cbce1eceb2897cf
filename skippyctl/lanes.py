"""skippyctl lanes list|drain|undrain: the head's connections down the pipeline."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Column, Table

from skippyctl.client import ControlError, call_once
from skippyctl.render import emit, fail, listing
from skippyd.control import messages as m

app = typer.Typer(help="Inspect, drain and undrain the head's lanes.", no_args_is_help=True)

JSON = Annotated[bool, typer.Option("--json", help="Plain JSON on stdout.")]


def _table(data: dict) -> Table:
    title = f"downstream {data.get('downstream')}" + (" (draining)" if data.get("draining") else "")
    table = listing("lane", "state", Column("session", no_wrap=True), Column("downstream", no_wrap=True),
                    "generations", title=title)
    for lane in data["lanes"]:
        table.add_row(str(lane["lane_id"]), lane["state"], str(lane["session_id"] or "-"), str(lane["downstream"]),
                      str(lane["generations"]))
    return table


def _run(ctx: typer.Context, make, json_mode: bool) -> None:
    try:
        data = call_once(ctx.obj.url, ctx.obj.token_file, make)
    except ControlError as exc:
        fail(str(exc))
    emit(data, json_mode, _table)


@app.command("list")
def list_(ctx: typer.Context, json_mode: JSON = False) -> None:
    """List lanes and their state."""
    _run(ctx, lambda i: m.LanesList(id=i), json_mode)


@app.command("drain")
def drain(ctx: typer.Context, json_mode: JSON = False) -> None:
    """Stop new generations; running ones finish, then idle lanes close."""
    _run(ctx, lambda i: m.LanesDrain(id=i), json_mode)


@app.command("undrain")
def undrain(ctx: typer.Context, json_mode: JSON = False) -> None:
    """Accept new generations again."""
    _run(ctx, lambda i: m.LanesUndrain(id=i), json_mode)
