"""skippyctl sessions list|show|kill: the generations running on the head."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from skippyctl.client import ControlError, call_once
from skippyctl.render import emit, fail
from skippyd.control import messages as m

app = typer.Typer(help="Inspect and kill running generations (sessions).", no_args_is_help=True)

JSON = Annotated[bool, typer.Option("--json", help="Plain JSON on stdout.")]


def _table(rows: list[dict]) -> Table:
    table = Table("session", "state", "prompt", "generated", "position", "age s", "lane", "seq (stage 0)")
    for r in rows:
        table.add_row(str(r["session_id"]), r["state"], str(r["prompt_tokens"]), str(r["generated"]),
                      str(r["position"]), f"{r['age_s']:.1f}", str(r["lane"]), str(r["stages"]["0"]["seq"]))
    return table


def _call(ctx: typer.Context, make):
    try:
        return call_once(ctx.obj.url, ctx.obj.token_file, make)
    except ControlError as exc:
        fail(str(exc))


@app.command("list")
def list_(ctx: typer.Context, json_mode: JSON = False) -> None:
    """List running sessions."""
    emit(_call(ctx, lambda i: m.SessionsList(id=i)), json_mode, _table)


@app.command("show")
def show(ctx: typer.Context, session_id: Annotated[int, typer.Argument(help="Session id.")],
         json_mode: JSON = False) -> None:
    """Show one session."""
    emit(_call(ctx, lambda i: m.SessionShow(id=i, session_id=session_id)), json_mode, lambda r: _table([r]))


@app.command("kill")
def kill(ctx: typer.Context, session_id: Annotated[int, typer.Argument(help="Session id.")],
         json_mode: JSON = False) -> None:
    """Cancel a running session; it is released on every stage."""
    data = _call(ctx, lambda i: m.SessionKill(id=i, session_id=session_id))
    emit(data, json_mode, lambda d: f"killed session {d['killed']}")
