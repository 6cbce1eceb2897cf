"""A deployed head serves its OpenAI API with the settings the daemon's own start-up applies: the API key, the
metrics access, and every setting of its stage.

Three waiting daemons, each a network namespace (tests/netns.py), started with ``--openai`` and
``--api-key-file``: one deployment over all three (supervised), the same again unsupervised, and one on a
single host. Each time the head answers /v1/* 401 without the key and 200 with it, /health without, and
/metrics as its ``openai.public_metrics`` says. Then the single host's stage is started the other way
(``skippyd --topology … --stage 0`` with the same flags, in the same namespace), and the settings in force,
as status shows them, are the same.
"""

from __future__ import annotations

import os

import pytest

from tests import netns
from tests.deploy_hosts import FLAGS, Hosts, generate
from tests.openai_api import httpx2
from tests.procs import Daemon

pytestmark = pytest.mark.slow  # real daemon processes in network namespaces

KEY = "a-deployed-head-keeps-its-key"
OPENAI_PORT = 8111


def check_access(address: str, *, public_metrics: bool) -> None:
    """The head's API at `address` asks for the key on /v1/* and, unless public, on /metrics; /health is open."""
    with httpx2.Client(base_url=f"http://{address}:{OPENAI_PORT}", timeout=60) as h:
        bearer = {"authorization": f"Bearer {KEY}"}
        refused = h.get("/v1/models")
        assert refused.status_code == 401, refused.text
        assert refused.headers["www-authenticate"] == "Bearer"
        assert h.get("/v1/models", headers={"authorization": "Bearer wrong-key-here"}).status_code == 401
        models = h.get("/v1/models", headers=bearer)
        assert models.status_code == 200, models.text
        model = models.json()["data"][0]["id"]
        assert h.get(f"/v1/models/{model}").status_code == 401
        assert h.get(f"/v1/models/{model}", headers=bearer).status_code == 200
        body = {"model": model, "prompt": "The sea", "max_tokens": 2, "temperature": 0}
        assert h.post("/v1/completions", json=body).status_code == 401
        assert h.post("/v1/completions", json=body, headers=bearer).json()["usage"]["completion_tokens"] == 2
        assert h.get("/health").status_code == 200
        assert h.get("/metrics").status_code == (200 if public_metrics else 401)
        assert h.get("/metrics", headers=bearer).status_code == 200


@pytest.fixture(scope="module")
def net():
    with netns.network_for_test(3) as network:
        yield network


def test_a_deployed_head_keeps_its_api_key_and_runs_with_the_daemons_own_settings(net, default_model_path,
                                                                                    tmp_path):
    key = tmp_path / "api.key"
    key.write_text(KEY + "\n")
    os.chmod(key, 0o600)
    common = [*FLAGS, "--openai", f"0.0.0.0:{OPENAI_PORT}", "--api-key-file", str(key)]
    # host 1 serves /metrics to all; the others ask for the key there too
    configs = [{"openai.public_metrics": k == 1} for k in range(3)]
    hosts = Hosts(net, tmp_path, tmp_path / "cache", configs=configs, common=common)
    names = hosts.data_hosts().split(",")
    try:
        for how in ((), ("--no-supervise",)):  # three hosts, supervised and not
            deployed = hosts.deploy(default_model_path, "--stages", "3", *how)
            head = names.index(deployed["plan"]["stages"][0]["host"])
            assert (deployed["supervised"] is None) == bool(how), deployed["supervised"]
            status = hosts.daemons[head].status()
            assert (status["deployment"]["supervised"] is None) == bool(how)
            assert [entry["api_key"] for entry in status["listeners"] if entry["what"] == "openai"] == [True]
            check_access(hosts.daemons[head].control_host, public_metrics=head == 1)
            assert hosts.skippyctl("undeploy").returncode == 0  # (the same plan again would keep its supervisor)
        # one host: the whole model as stage 0 of 1 (nothing to supervise)
        proc = hosts.skippyctl("deploy", str(default_model_path), "--hosts", hosts.data_hosts([1]), "--json")
        assert proc.returncode == 0, proc.stderr
        single = hosts.daemons[1]
        check_access(single.control_host, public_metrics=True)
        deployed_settings = single.status()["settings"]
        assert deployed_settings["openai"] == {"listen": f"0.0.0.0:{OPENAI_PORT}", "model_id": None, "api_key": True,
                                               "public_metrics": True}
        want = generate(single, prompt="The three primary colours are", raw=True, max_tokens=8)
        assert hosts.skippyctl("undeploy", "--hosts", hosts.data_hosts([1])).returncode == 0
        topology = hosts.slices(1) / "deployed-topology.toml"
    finally:
        hosts.stop()

    # the same stage, started by the daemon's own start-up in the same namespace with the same flags
    started = Daemon(["--topology", str(topology), "--stage", "0", *common], tmp_path, "startup", config=configs[1],
                     prefix=net.hosts[1].exec_prefix(), control_host="0.0.0.0")
    started.control_host = net.hosts[1].control_host
    try:
        started.wait_ready(120)
        status = started.status()
        assert status["deployment"] is None and status["role"] == "head"
        assert status["settings"] == deployed_settings
        check_access(started.control_host, public_metrics=True)
        got = generate(started, prompt="The three primary colours are", raw=True, max_tokens=8)
        assert got["tokens"] == want["tokens"]
    finally:
        assert started.stop() == 0, started.log()

