"""skippyctl sessions list|show|kill: the generations running on the head."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Column, Table

from skippyctl.render import ask, emit, listing
from skippyd.control import messages as m

app = typer.Typer(help="Inspect and kill running generations (sessions).", no_args_is_help=True)

JSON = Annotated[bool, typer.Option("--json", help="Plain JSON on stdout.")]


def _table(rows: list[dict]) -> Table | str:
    if not rows:
        return "no running sessions"
    # session ids are 19 digits: never cut them (people copy them into `sessions kill`)
    table = listing(Column("session", no_wrap=True, min_width=19), Column("state", no_wrap=True),
                    *(Column(name, no_wrap=True, justify="right") for name in ("prompt", "gen", "tok/s", "pos",
                                                                                "age s", "lane")),
                    "seq", caption="prompt/gen: tokens; tok/s: decode so far; seq: KV sequence by stage")
    for r in rows:
        seqs = ", ".join(f"{k}:{v['seq']}" for k, v in sorted(r["stages"].items()) if v) or "-"
        rate = r.get("decode_tokens_per_s")  # the head's sessions only (a stage does not time them)
        table.add_row(str(r["session_id"]), r["state"], _dash(r["prompt_tokens"]), str(r["generated"]),
                      "-" if rate is None else f"{rate:.1f}", str(r["position"]), f"{r['age_s']:.1f}",
                      _dash(r["lane"]), seqs)
    return table


def _dash(value) -> str:
    return "-" if value is None else str(value)


@app.command("list")
def list_(ctx: typer.Context, json_mode: JSON = False) -> None:
    """List running sessions."""
    emit(ask(ctx, lambda i: m.SessionsList(id=i)), json_mode, _table)


@app.command("show")
def show(ctx: typer.Context, session_id: Annotated[int, typer.Argument(help="Session id.")],
         json_mode: JSON = False) -> None:
    """Show one session."""
    emit(ask(ctx, lambda i: m.SessionShow(id=i, session_id=session_id)), json_mode, lambda r: _table([r]))


@app.command("kill")
def kill(ctx: typer.Context, session_id: Annotated[int, typer.Argument(help="Session id.")],
         json_mode: JSON = False) -> None:
    """Cancel a running session; it is released on every stage."""
    data = ask(ctx, lambda i: m.SessionKill(id=i, session_id=session_id, wait=True))
    emit(data, json_mode, lambda d: f"killed session {d['killed']}" + ("" if d["released"] else
                                                                              " (still releasing)"))
