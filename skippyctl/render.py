"""The one place skippyctl prints: data on stdout, errors and progress on stderr.

Every command that prints data calls `emit`: a rich table for people, or
plain JSON (`--json`) for scripts. Errors go through `fail`, which prints a
single "error: ..." line and exits non-zero without a traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from skippyctl.client import ControlError, call_once

# Exit codes: 1 = the operation failed, 2 = the request was invalid (as for usage errors).
EXIT_FAILURE = 1
EXIT_USAGE = 2


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def emit(data: Any, json_mode: bool, table_builder: Callable[[Any], RenderableType]) -> None:
    """Print `data` on stdout: as JSON with `json_mode`, else as `table_builder(data)`."""
    if json_mode:
        sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
        sys.stdout.flush()
        return
    # Created per call so that it writes to the current sys.stdout (CliRunner swaps it).
    Console(highlight=False).print(table_builder(data))


class _Listing(Table):
    """A table whose caption, when a line of it is wider than the table, goes below it at the console's width
    instead of wrapping at the table's (a listing without rules is narrow: a line of listeners broke in three)."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        caption = self.caption
        if not caption or (max(map(len, str(caption).splitlines()), default=0)
                           <= self.__rich_measure__(console, options).maximum):  # (measured only with a caption)
            yield from super().__rich_console__(console, options)
            return
        self.caption = None
        try:
            yield from super().__rich_console__(console, options)
        finally:
            self.caption = caption
        yield caption


def listing(*columns, **kwargs) -> Table:
    """A table of what a daemon runs (stages, sessions, lanes): no rules, so that a listing fits 80 characters
    (a pipe's width) without rich cutting an address's port or a count short. Title and caption are plain
    text: they carry addresses and error messages, whose brackets rich would take for markup."""
    for key in ("title", "caption"):
        if isinstance(kwargs.get(key), str):
            kwargs[key] = Text(kwargs[key], style=f"table.{key}")
    return _Listing(*columns, box=None, pad_edge=False, header_style="bold", **kwargs)


def human_bytes(n: int) -> str:
    """A byte count in binary units, as budgets are given (MiB): "0 B", "812 B", "3.4 KiB", "512 MiB"."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"


def entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print "error: message" on stderr and exit with `code`, without a traceback."""
    # Plain write, not rich: messages contain brackets ("[::1]:7400") rich would eat.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise typer.Exit(code)


def ask(ctx: typer.Context, make) -> Any:
    """One request to the daemon the command was pointed at (``make(id)`` builds it); its data, or exit with
    the daemon's or the connection's error."""
    try:
        return call_once(ctx.obj.url, ctx.obj.token_file, make)
    except ControlError as exc:
        fail(str(exc))


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


@contextlib.contextmanager
def byte_progress(description: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr; yields `update(done_bytes, total_bytes)`.

    The bar pulses until the first update, which covers work that cannot
    report progress (parsing a model's metadata). Nothing is drawn when
    stderr is not a terminal, so scripts and logs stay clean.
    """
    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    console = stderr_console()
    if not console.is_terminal:
        # Even an idle rich Progress writes a blank line when it stops.
        yield lambda done, total: None
        return
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total or None)

        yield update


@contextlib.contextmanager
def waiting_line(description: str) -> Iterator[Callable[[], None]]:
    """A spinner with the time elapsed on stderr, for a wait that reports nothing (a long prompt's prefill
    before the first token: tens of seconds with a big model); yields `stop()`, which clears it, as does the
    block's end. Nothing is drawn when stderr is not a terminal."""
    console = stderr_console()
    if not console.is_terminal:
        yield lambda: None
        return
    progress = Progress(SpinnerColumn(), TextColumn(description), TimeElapsedColumn(), console=console,
                        transient=True)
    progress.add_task(description, total=None)
    progress.start()
    try:
        yield progress.stop
    finally:
        progress.stop()


@contextlib.contextmanager
def host_progress(hosts: list[str], description: str) -> Iterator[Callable[[str, int, int], None]]:
    """One progress bar per host on stderr; yields `update(host, done_bytes, total_bytes)`. Without a terminal,
    one line per host when its work begins and when it ends."""
    console = stderr_console()
    if not console.is_terminal:
        started: set[str] = set()
        finished: set[str] = set()

        def line(host: str, done: int, total: int) -> None:
            if host not in started:
                started.add(host)
                console.print(f"{description} {host}: {human_bytes(total - done)} to send")
            if done >= total and host not in finished:
                finished.add(host)
                console.print(f"{description} {host}: done")

        yield line
        return
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), DownloadColumn(),
               TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {host: progress.add_task(f"{description} {host}", total=None) for host in hosts}

        def update(host: str, done: int, total: int) -> None:
            progress.update(tasks[host], completed=done, total=total or None)

        yield update
