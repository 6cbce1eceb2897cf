"""Waiting daemons on hosts of their own, and skippyctl run on one of them: for the deployment tests and
bench/bench_deploy.py.

Each host is a network namespace (tests/netns.py) running `skippyd` with
neither a topology nor a model; they share one control token. `skippyctl`
runs on host 0, as an operator would on one of the machines, and reaches the
others over the data network (10.77.0.0/24), where their stages then listen;
the test reads each daemon's status over its management link.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from skippyctl.client import call_once
from skippyd.control import messages as m
from skippyd.control.token import load_or_create_token
from tests import netns
from tests.procs import REPO, Daemon

FLAGS = ["--lanes", "2", "--ctx", "512"]


def generate(daemon: Daemon, **kw) -> dict:
    return call_once(daemon.url, daemon.token_file, lambda i: m.Generate(id=i, stream=False, **kw))


class Hosts:
    """One waiting skippyd per host of `net`, sharing one control token; slices in `work`/slices-K."""

    def __init__(self, net: netns.Network, work: Path, cache: Path, *, configs: list[dict] | None = None,
                 prefixes: list[list[str]] | None = None, common: list[str] = FLAGS):
        self.net, self.work = net, work
        self.cache = cache  # skippyctl's: the slices it cuts, kept for the next test
        self.daemons: list[Daemon] = []
        token = load_or_create_token(work / "seed.token")
        for k, host in enumerate(net.hosts):
            (work / f"host{k}.token").write_text(token + "\n")
            os.chmod(work / f"host{k}.token", 0o600)
            d = Daemon([*common, "--slices-dir", str(self.slices(k))], work, f"host{k}",
                       config=configs[k] if configs else None,
                       prefix=[*(prefixes[k] if prefixes else []), *host.exec_prefix()], control_host="0.0.0.0")
            d.control_host = host.control_host  # the test's way in: the management link
            self.daemons.append(d)
        for d in self.daemons:
            d.wait_ready()
        self.token_file = work / "host0.token"

    def slices(self, k: int) -> Path:
        return self.work / f"slices-{k}"

    def data_hosts(self, which=None) -> str:
        """--hosts: every host's data address and control port."""
        ks = range(len(self.daemons)) if which is None else which
        return ",".join(f"{self.net.hosts[k].address}:{self.daemons[k].control_port}" for k in ks)

    def skippyctl(self, *args: str, token_file: Path | None = None, timeout: float = 240,
                  background: bool = False):
        """skippyctl on host 0, as the operator; its cache and state under `work`."""
        cmd = [*self.net.hosts[0].exec_prefix(), sys.executable, "-m", "skippyctl.app",
               "--token-file", str(token_file or self.token_file), *args]
        env = {**os.environ, "SKIPPY_CACHE_DIR": str(self.cache), "XDG_STATE_HOME": str(self.work / "state")}
        if background:
            return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)

    def deploy(self, model: Path, *args: str, **kw) -> dict:
        proc = self.skippyctl("deploy", str(model), "--hosts", self.data_hosts(), "--json", *args, **kw)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def head_generate(self, deployed: dict, **kw) -> dict:
        """A generation on the deployment's head."""
        head = deployed["plan"]["stages"][0]["host"]
        return generate(self.daemons[self.data_hosts().split(",").index(head)], **kw)

    def stop(self) -> None:
        for d in self.daemons:  # a clean exit, or the SIGKILL a test gave it
            assert d.stop() in (0, -signal.SIGKILL), d.log()
