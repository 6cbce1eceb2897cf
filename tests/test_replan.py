"""Planning again around a running head (skippyd.deploy.planner.plan_tail): the head keeps its host and layers,
the rest goes by the planner's rule, and a shortfall is named."""

from __future__ import annotations

import pytest

from skippyd.deploy.planner import HostInfo, PlanRefused, model_shape, plan_tail, stage_memory

MIB = 1 << 20


@pytest.fixture(scope="module")
def shape(default_model_path):
    return model_shape(default_model_path)


def test_the_head_keeps_its_layers_and_the_rest_goes_by_speed(shape):
    head = HostInfo("a", 1 << 40, 1.0)
    others = [HostInfo("b", 1 << 40, 1.0), HostInfo("c", 1 << 40, 3.0)]
    plan = plan_tail(shape, head, 10, others, ctx=512, lanes=2, stages=2)
    assert plan.ranges[0] == (0, 10) and plan.hosts[0] == "a" and plan.ranges[-1][1] == shape.n_layer
    slow = dict(zip(plan.hosts, (s.layer_end - s.layer_start for s in plan.stages)))
    assert slow["c"] < slow["b"], plan  # the slower host gets fewer layers
    # the fewest stages that fit when no count is asked: one host takes all the rest
    assert len(plan_tail(shape, head, 10, others, ctx=512, lanes=2).stages) == 2
    # the same inputs, the same plan
    assert plan_tail(shape, head, 10, others, ctx=512, lanes=2, stages=2) == plan


def test_too_little_memory_names_the_shortfall_and_the_hosts(shape):
    need = stage_memory(shape, 10, shape.n_layer, ctx=512, lanes=2)
    head = HostInfo("hostA", 1 << 40, 1.0)
    with pytest.raises(PlanRefused) as one:
        plan_tail(shape, head, 10, [HostInfo("hostC", need - 20 * MIB, 1.0)], ctx=512, lanes=2)
    assert str(one.value).startswith("the model needs 20 MiB more than hostC holds"), one.value
    with pytest.raises(PlanRefused) as two:
        plan_tail(shape, head, 10, [HostInfo("hostB", 40 * MIB, 1.0), HostInfo("hostC", 40 * MIB, 1.0)],
                  ctx=512, lanes=2)
    assert "more than hostB and hostC hold" in str(two.value), two.value
    with pytest.raises(PlanRefused, match="none is left"):
        plan_tail(shape, head, 10, [], ctx=512, lanes=2)


def test_a_hosts_prefix_cache_budget_counts_against_its_memory(shape):
    need = stage_memory(shape, 10, shape.n_layer, ctx=512, lanes=2)
    head = HostInfo("hostA", 1 << 40, 1.0)
    fits = HostInfo("hostC", need + 10 * MIB, 1.0)
    assert list(plan_tail(shape, head, 10, [fits], ctx=512, lanes=2).hosts) == ["hostA", "hostC"]
    with pytest.raises(PlanRefused) as refused:
        plan_tail(shape, head, 10, [HostInfo("hostC", need + 10 * MIB, 1.0, prefix_cache_bytes=30 * MIB)],
                  ctx=512, lanes=2)
    assert str(refused.value).startswith("the model needs 20 MiB more than hostC holds"), refused.value
