"""skippyctl cache show|clear: every stage's prefix cache (the KV of prompts it has computed)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Column, Table

from skippyctl.render import ask, emit, entries, human_bytes, listing
from skippyd.control import messages as m

app = typer.Typer(help="Inspect and empty the stages' prefix caches.", no_args_is_help=True)

JSON = Annotated[bool, typer.Option("--json", help="Plain JSON on stdout.")]


def budget(row: dict) -> str:
    return human_bytes(row["budget_bytes"]) if row["budget_bytes"] else "off"


def hit_rate(row: dict) -> str:
    return f"{100 * row['hit_rate']:.0f}% of {row['lookups']}" if row["lookups"] else "-"


def _table(rows: list[dict]) -> Table | str:
    if not rows:
        return "no stages here"
    table = listing("stage", *(Column(name, no_wrap=True, justify="right") for name in
                               ("entries", "tokens", "bytes", "budget", "hit rate", "restored", "evictions")),
                    caption="hit rate: of the lookups; restored: prompt tokens restored rather than computed")
    for r in rows:
        table.add_row(str(r["stage"]), str(r["entries"]), str(r["tokens"]), human_bytes(r["bytes"]), budget(r),
                      hit_rate(r), str(r["restored_tokens"]), str(r["evictions"]))
    return table


def _cleared(rows: list[dict]) -> str:
    lines = [f"stage {r['stage']}: cleared {entries(r['cleared'])} ({human_bytes(r['cleared_bytes'])})"
             if r.get("cleared") is not None else f"stage {r['stage']}: cleared" for r in rows]
    return "\n".join(lines) or "no stages here"


@app.command("show")
def show(ctx: typer.Context, json_mode: JSON = False) -> None:
    """Per stage: entries, tokens and bytes held, the budget, the hit rate."""
    emit(ask(ctx, lambda i: m.CacheShow(id=i)), json_mode, _table)


@app.command("clear")
def clear(ctx: typer.Context, json_mode: JSON = False) -> None:
    """Empty every stage's prefix cache (running sessions keep what they hold)."""
    emit(ask(ctx, lambda i: m.CacheClear(id=i)), json_mode, _cleared)
