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


def _table(rows: list[dict]) -> Table | str:
    if not rows:
        return "no stages here"
    table = listing(Column("stage", no_wrap=True), *(Column(name, no_wrap=True, justify="right") for name in
                                       ("entries", "tokens", "bytes", "budget", "hits", "restored", "evictions")),
                    caption="hits: lookups each tier served; restored: prompt tokens "
                            "restored rather than computed; evictions: entries memory let go (to disk, when its "
                            "tier is on)")
    for r in rows:
        disk = r.get("disk") or {}
        table.add_row(f"{r['stage']} memory", str(r["entries"]), str(r["tokens"]), human_bytes(r["bytes"]),
                      budget(r), str(r.get("memory_hits", r["hits"])), str(r["restored_tokens"]),
                      str(r["evictions"]))
        table.add_row("  disk", *([str(disk["entries"]), str(disk["tokens"]), human_bytes(disk["bytes"]),
                                     human_bytes(disk["budget_bytes"]), str(disk["hits"])]
                                    if disk.get("on") else ["-", "-", "-", "off", "-"]), "", "")
    return table


def _cleared(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        line = (f"stage {r['stage']}: cleared {entries(r['cleared'])} ({human_bytes(r['cleared_bytes'])})"
                if r.get("cleared") is not None else f"stage {r['stage']}: cleared")
        if r.get("cleared_disk"):
            line += f"; on disk {entries(r['cleared_disk'])} ({human_bytes(r['cleared_disk_bytes'])})"
        lines.append(line)
    return "\n".join(lines) or "no stages here"


@app.command("show")
def show(ctx: typer.Context, json_mode: JSON = False) -> None:
    """Per stage and tier (memory, disk): entries, tokens and bytes held, the budget, the hits."""
    emit(ask(ctx, lambda i: m.CacheShow(id=i)), json_mode, _table)


@app.command("clear")
def clear(ctx: typer.Context, json_mode: JSON = False,
          disk: Annotated[bool, typer.Option("--disk", help="Empty the disk tiers too.")] = False) -> None:
    """Empty every stage's prefix cache (running sessions keep what they hold); --disk: its disk tier too."""
    emit(ask(ctx, lambda i: m.CacheClear(id=i, disk=disk)), json_mode, _cleared)
