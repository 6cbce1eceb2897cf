"""skippyctl: the command line for skippy (one module per noun).

Global options (`--url`, `--token-file`) are parsed once in the callback and
handed to every noun as `ctx.obj`, a `Globals`. Nouns that talk to a daemon
read the control URL and token from there; `model` works on local files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import attrs
import typer

DEFAULT_URL = "ws://127.0.0.1:7390"


@attrs.frozen
class Globals:
    """Options shared by every command (`ctx.obj`)."""

    url: str = DEFAULT_URL
    token_file: Path | None = None


app = typer.Typer(
    name="skippyctl",
    help="Control skippy: pipeline-parallel LLM inference on libllama.",
    no_args_is_help=True,
    add_completion=False,
    # Unexpected errors still show a traceback, but never local variables (tokens).
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _globals(
    ctx: typer.Context,
    url: Annotated[
        str, typer.Option("--url", envvar="SKIPPY_URL", help="Control websocket of the daemon.")
    ] = DEFAULT_URL,
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", envvar="SKIPPY_TOKEN_FILE", help="File holding the control token."),
    ] = None,
) -> None:
    ctx.obj = Globals(url=url, token_file=token_file)


# Nouns register here, one module each. Imported after `Globals` exists so a
# noun module may import it from here.
from skippyctl import cache as _cache  # noqa: E402
from skippyctl import deploy as _deploy  # noqa: E402
from skippyctl import generate as _generate  # noqa: E402
from skippyctl import lanes as _lanes  # noqa: E402
from skippyctl import model as _model  # noqa: E402
from skippyctl import sessions as _sessions  # noqa: E402
from skippyctl import status as _status  # noqa: E402

app.command("generate")(_generate.generate)
app.add_typer(_sessions.app, name="sessions")
app.add_typer(_lanes.app, name="lanes")
app.add_typer(_cache.app, name="cache")
app.command("status")(_status.status)
app.add_typer(_model.app, name="model")
app.command("plan")(_deploy.plan)
app.command("deploy")(_deploy.deploy)
app.command("undeploy")(_deploy.undeploy)


def main() -> None:
    """Console-script entry point (`skippyctl`)."""
    app()


if __name__ == "__main__":
    main()
