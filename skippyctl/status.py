"""skippyctl status: what the daemon runs and whether its pipeline is whole."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from skippyctl.client import ControlError, call_once
from skippyctl.render import emit, fail
from skippyd.control import messages as m


def _table(data: dict) -> Table:
    model = data.get("model") or {}
    table = Table("stage", "address", "layers", "local", "reachable",
                  title=f"{data['role']} · {model.get('name', '?')} · up {data['uptime_s']:.0f}s"
                        + (" · draining" if data.get("draining") else ""))
    for s in (data.get("topology") or {}).get("stages", []):
        table.add_row(str(s["index"]), s["address"], f"[{s['layers'][0]},{s['layers'][1]})",
                      "yes" if s["local"] else "no", "yes" if s["reachable"] else "NO")
    return table


def status(ctx: typer.Context,
           json_mode: Annotated[bool, typer.Option("--json", help="Plain JSON on stdout.")] = False) -> None:
    """Role, model, stages and their reachability, uptime and load."""
    try:
        data = call_once(ctx.obj.url, ctx.obj.token_file, lambda i: m.Status(id=i))
    except ControlError as exc:
        fail(str(exc))
    emit(data, json_mode, _table)
