"""The node (skippyd/node.py): the one way a stage starts, whatever asked for it."""

from __future__ import annotations

import pytest

from skippyd.config import Config, with_values
from skippyd.node import Node
from skippyd.plan import plan_daemon
from skippyd.topology import Topology
from tests.procs import split_for_test


@pytest.mark.parametrize("stage", [0, 1])
def test_a_deployed_stage_is_planned_as_the_daemons_start_up_plans_it(tiny_model_path, tmp_path, stage):
    """What a deploy runs (Node.plan_stage) is what ``skippyd --topology FILE --stage K`` with the same settings
    runs (plan_daemon): the same StageConfig, head options, link secret and API key."""
    split_for_test(tiny_model_path, 2, tmp_path)
    key = tmp_path / "api.key"
    key.write_text("the-api-key-of-this-test\n")
    secret = tmp_path / "link.secret"
    secret.write_text("a-link-secret-of-32-characters-at-least!\n")
    key.chmod(0o600)
    secret.chmod(0o600)
    config = with_values(Config(), {"pipeline.topology": tmp_path / "topology.toml", "pipeline.stage": stage,
                                    "runtime.lanes": 3, "runtime.ctx": 384, "runtime.prefill_chunk": 32,
                                    "openai.api_key_file": key, "stage.link_secret_file": secret})
    startup = plan_daemon(config)
    node = Node(config)
    node.link_auth, node.api_key = startup.link_auth, startup.api_key  # what Node.run keeps of the daemon's plan
    deployed = node.plan_stage(Topology.load(tmp_path / "topology.toml"), stage)
    assert deployed.api_key is startup.api_key and startup.api_key is not None and startup.link_auth
    assert deployed == startup


async def test_a_node_with_no_stages_describes_none_and_releases_nothing():
    node = Node(Config())
    assert node.describe_settings() is None and node.engine is None and node.pool is None
    assert not await node.release("nothing runs")
    assert node.running() == 0 and node.describe_role() == ""
