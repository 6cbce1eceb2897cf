"""The control token: where it lives and how it is made (no heavy imports: skippyctl uses this too)."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("skippyd.control")

TOKEN_NAME = "control.token"


def default_token_file() -> Path:
    """$STATE_DIRECTORY/control.token under systemd, else $XDG_STATE_HOME (~/.local/state)/skippy/control.token."""
    state = os.environ.get("STATE_DIRECTORY")
    if state:
        return Path(state.split(":")[0]) / TOKEN_NAME
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local/state")
    return Path(base) / "skippy" / TOKEN_NAME


def load_or_create_token(path: Path) -> str:
    """Read the token; create it (mode 0600, owner only) on first start."""
    if path.exists():
        token = path.read_text().strip()
        if token:
            mode = path.stat().st_mode & 0o077
            if mode:
                log.warning("the control token %s is readable by others (mode %o); chmod 600 it", path,
                            path.stat().st_mode & 0o777)
            return token
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)  # a reader never sees a half-written token
    log.info("created a new control token in %s", path)
    return token
