"""Man pages and systemd units: complete, rendered, warning-free, and accepted by systemd-analyze.

Checks that need a tool (man, groff, scdoc, systemd-analyze) skip without it,
saying which; scripts/test installs them when it can.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import typer.main

from skippyctl.app import app
from skippyd import config as cfgmod
from skippyd.cli import build_parser, moved_flags

REPO = Path(__file__).resolve().parent.parent
MAN = REPO / "man"
UNITS = REPO / "systemd"
OURS = ["skippyd.8", "skippyctl.1", "skippyd.toml.5"]
SECTIONS = ["NAME", "SYNOPSIS", "OPTIONS", "FILES", "ENVIRONMENT", "SIGNALS", "EXIT STATUS", "SEE ALSO"]


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (scripts/test installs it when run as root with apt-get)")
    return path


def render(page: str) -> str:
    """The page as `man -l` shows it: plain ASCII text, wide lines (nothing hyphenated)."""
    need("man")
    proc = subprocess.run(["man", "-l", str(MAN / page)], capture_output=True, text=True,
                          env={**os.environ, "MANWIDTH": "200", "LC_ALL": "C", "MANPAGER": "cat", "PAGER": "cat"})
    if proc.returncode != 0 or "NAME" not in proc.stdout:
        pytest.skip(f"man cannot render pages here: {proc.stderr.strip() or proc.returncode}")
    return re.sub(r".\x08", "", proc.stdout)  # no overstrike bold


def source(page: str) -> str:
    return (MAN / f"{page}.scd").read_text()


# ---------------------------------------------------------------- content
def cli_tree():
    """(command path, [option names]) for skippyctl and every subcommand."""
    out = []

    def walk(cmd, path):
        opts = [o for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)]
        out.append((path, opts))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return out


def test_every_skippyctl_command_and_option_is_in_skippyctl_1():
    text = source("skippyctl.1")
    rendered = render("skippyctl.1") if shutil.which("man") else None
    for path, opts in cli_tree():
        if path:
            assert f"skippyctl {' '.join(path)}" in re.sub(r"[*_]", "", text), f"command {' '.join(path)}"
        for opt in opts:
            where = " ".join(["skippyctl", *path])
            assert re.search(rf"\*{re.escape(opt)}\*", text), f"{where}: {opt} not in skippyctl.1.scd"
            if rendered is not None:
                assert re.search(rf"(^|[\s,\[|(]){re.escape(opt)}\b", rendered), f"{where}: {opt} not rendered"


def test_every_skippyd_flag_and_config_key_is_documented():
    skippyd8, toml5 = source("skippyd.8"), source("skippyd.toml.5")
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag not in moved_flags():
                assert f"*{flag}*" in skippyd8, f"skippyd(8) lacks {flag}"
    for flag, key in moved_flags().items():  # tuning: a key of the file only, not an option
        assert not re.search(rf"^\*{re.escape(flag)}\*", skippyd8, re.M), f"skippyd(8) lists {flag} as an option"
        assert f"*{key.split('.')[1]}* =" in toml5, f"skippyd.toml(5) lacks {key}"
    example = (UNITS / "skippyd.toml.example").read_text()
    for key, _ in cfgmod.Config().items():
        section, name = key.split(".")
        assert f"## [{section}]" in toml5 and f"*{name}* =" in toml5, f"skippyd.toml(5) lacks {key}"
        assert re.search(rf"^#? ?{name} = ", example, re.M), f"skippyd.toml.example lacks {key}"
        assert f"*{key}*" in skippyd8, f"skippyd(8) does not name the key {key}"
    assert cfgmod.load(UNITS / "skippyd.toml.example").pipeline.stage == 0  # the example is valid


def test_pages_have_the_standard_sections():
    for page in OURS:
        headings = re.findall(r"^# (.+)$", source(page), re.M)
        missing = [s for s in SECTIONS if s not in headings]
        assert not missing, f"{page}: no {missing}"


def test_pages_are_installed_with_the_package():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    installed = {Path(f).name: Path(d).name for d, files in data.items() for f in files}
    for roff in sorted(p.name for p in MAN.iterdir() if p.suffix[1:].isdigit()):
        assert installed.get(roff) == f"man{roff[-1]}", f"{roff} is not in [tool.setuptools.data-files]"


# ---------------------------------------------------------------- rendering
@pytest.mark.parametrize("page", OURS + ["skippy-protocol.7"])
def test_page_renders_without_warnings(page):
    need("man")
    proc = subprocess.run(["man", "--warnings", "-l", str(MAN / page)], capture_output=True, text=True,
                          env={**os.environ, "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    groff = need("groff")
    proc = subprocess.run([groff, "-k", "-ww", "-z", "-man", "-Tutf8", str(MAN / page)], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("page", OURS)
def test_rendered_roff_is_up_to_date(page):
    scdoc = need("scdoc")
    fresh = subprocess.run([scdoc], input=source(page), capture_output=True, text=True, check=True,
                           env={**os.environ, "SOURCE_DATE_EPOCH": "0"}).stdout

    def body(roff: str) -> list[str]:  # without the generator's version and the date
        return [line for line in roff.splitlines() if not line.startswith((".TH", '.\\" Generated by'))]

    assert body((MAN / page).read_text()) == body(fresh), f"man/{page} is stale: run man/render"


# ---------------------------------------------------------------- systemd
def unit(name: str) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            keys.setdefault(key.strip(), []).append(value.strip())
    return keys


@pytest.mark.parametrize("name", ["skippyd.service", "skippyd@.service"])
def test_unit_settings(name):
    u = unit(name)
    one = {k: v[-1] for k, v in u.items()}
    assert one["Type"] == "notify" and one["Restart"] == "on-failure"
    assert "man:skippyd(8)" in one["Documentation"]
    assert float(one["TimeoutStopSec"]) > cfgmod.DaemonSection().drain_grace
    if name.startswith("skippyd@"):  # an instance's file must exist; the plain unit finds /etc/skippy's if any
        assert "--config %E/skippy/%i.toml" in one["ExecStart"]
    else:
        assert one["ExecStart"] == "/usr/local/bin/skippyd" and one["ConfigurationDirectory"] == "skippy"
    assert one["NoNewPrivileges"] == "yes" and one["ProtectSystem"] == "strict" and one["PrivateTmp"] == "yes"
    assert one["DynamicUser"] == "yes" or one.get("User") not in (None, "root")
    for key in ("RuntimeDirectory", "StateDirectory", "ConfigurationDirectory", "ExecReload"):
        assert key in one, key
    if name.startswith("skippyd@"):
        assert "%i" in one["ExecStart"] and "%i" in one["StateDirectory"]


def test_units_pass_systemd_analyze_verify(tmp_path):
    analyze = need("systemd-analyze")
    skippyd = Path(sys.executable).with_name("skippyd")
    assert skippyd.exists(), "the venv has no skippyd entry point (run scripts/setup)"
    manpath = tmp_path / "man"
    for page in OURS:
        (manpath / f"man{page[-1]}").mkdir(parents=True, exist_ok=True)
        shutil.copy(MAN / page, manpath / f"man{page[-1]}" / page)
    for name in ("skippyd.service", "skippyd@.service"):
        text = (UNITS / name).read_text().replace("/usr/local/bin/skippyd", str(skippyd))
        (tmp_path / name).write_text(text)
    for name in ("skippyd.service", "skippyd@stage1.service"):
        proc = subprocess.run([analyze, "verify", name], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "MANPATH": str(manpath)})
        if proc.returncode != 0 and "Failed to" in proc.stderr and "bus" in proc.stderr.lower():
            pytest.skip(f"systemd-analyze cannot run here: {proc.stderr.strip()}")
        # verify exits 0 even on unknown keys: any line at all is a finding
        assert proc.returncode == 0 and proc.stderr.strip() == "" and proc.stdout.strip() == "", \
            f"{name}:\n{proc.stdout}{proc.stderr}"


def _prose(page: str) -> str:
    """A page's scdoc source with its lines joined: a number and its words may sit on two lines."""
    return " ".join((MAN / f"{page}.scd").read_text().split())


def test_liveness_numbers_in_the_pages_are_the_codes():
    """The liveness bounds skippy-protocol(7) and skippyd(8) give are the constants the code runs with."""
    from skippyd.head.liveness import INTERVAL_S, PING_TIMEOUT_S
    from skippyd.stage.execution import INLINE_MAX_US
    from skippyd.stage.roles import PING_RELAY_S

    detected = INTERVAL_S + PING_TIMEOUT_S
    protocol = _prose("skippy-protocol.7")
    interval, timeout = re.search(r"waited on the pipeline for more than ([\d.]+) s, and waits ([\d.]+) s for the "
                                  r"answer", protocol).groups()
    assert (float(interval), float(timeout)) == (INTERVAL_S, PING_TIMEOUT_S)
    assert float(re.search(r"when none comes within ([\d.]+)\^K s", protocol).group(1)) == PING_RELAY_S
    inline, answers = re.search(r"any decode batch slower than ([\d.]+) s in a worker thread, so a busy stage "
                                r"answers within about ([\d.]+) s", protocol).groups()
    assert float(inline) == float(answers) == INLINE_MAX_US / 1e6
    assert float(re.search(r"fail within about ([\d.]+) s\.", protocol).group(1)) == pytest.approx(detected)
    assert re.search(r"Ping : down : Ack \(the final stage's, relayed by every stage before it", protocol)

    daemon = _prose("skippyd.8")
    within, interval, timeout = re.search(r"\*Stage 1 stops answering\* \(.*?\): within ([\d.]+) s\. While a "
                                          r"generation waits on the pipeline for more than ([\d.]+) s the head "
                                          r"pings stage 1 on a connection of its own; no answer within ([\d.]+) s",
                                          daemon).groups()
    assert float(within) == pytest.approx(detected)
    assert (float(interval), float(timeout)) == (INTERVAL_S, PING_TIMEOUT_S)
