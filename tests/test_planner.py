"""The deployment planner: the model's shape read from real GGUF files (checked against the stage files the
slicer writes), and the choice of stages, layers and hosts (checked against an exhaustive search)."""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from skippyd.deploy.planner import (
    MIB,
    DeployPlan,
    HostInfo,
    ModelShape,
    PlanError,
    PlanRefused,
    make_plan,
    model_shape,
    place,
    stage_memory,
)
from skippyd.runtime.gguf_info import ModelFileError, field_value, open_gguf
from skippyd.runtime.slicing import balanced_ranges, compute_costs, plan_ranges, split_model
from skippyd.topology import Topology
from tests.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def shape(default_model_path: Path) -> ModelShape:
    return model_shape(default_model_path)




def _tensor_bytes(reader) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in reader.tensors}


def _read_bytes(tensors: dict[str, int], *, first: bool, last: bool, tied: bool) -> int:
    """What a stage of a split reads of its own file: its layers, the embedding on the first stage, the output
    norm and the LM head (a tied model's embedding) on the final one."""
    total = sum(n for name, n in tensors.items() if name.startswith("blk."))
    if first or (last and tied):
        total += tensors["token_embd.weight"]
    if last:
        total += sum(n for name, n in tensors.items() if name.startswith(("output.", "output_norm.")))
    return total


def _check_against_split(shape: ModelShape, directory: Path, n_stages: int) -> None:
    files = sorted(directory.glob("stage-*.gguf"))
    assert len(files) == n_stages
    for k, path in enumerate(files):
        reader = open_gguf(path)
        start, end = field_value(reader, "skippy.layer_start"), field_value(reader, "skippy.layer_end")
        tensors = _tensor_bytes(reader)
        tied = "output.weight" not in tensors
        on_disk = sum(tensors.values())
        # the slice's tensor data, exactly; the file itself only adds its header and alignment padding
        assert shape.file_bytes(start, end) == on_disk
        size = path.stat().st_size
        assert 0 <= size - on_disk <= reader.data_offset + len(tensors) * int(reader.alignment)
        # what the stage reads: its layers plus the extras of its place in the pipeline
        expected = _read_bytes(tensors, first=k == 0, last=k == n_stages - 1, tied=tied)
        assert shape.weight_bytes(start, end) == expected
        extras = expected - sum(shape.layer_bytes[start:end])
        if k == 0:
            assert extras == shape.first_bytes
        elif k == n_stages - 1:
            assert extras == shape.last_bytes
        else:
            assert extras == 0


@pytest.mark.slow  # the run's splits of the default model (written once; each stage file parses the vocabulary)
@pytest.mark.parametrize("n_stages", [2, 3])
def test_shape_matches_the_stage_files_split_model_writes(shape, split_files, n_stages):
    _check_against_split(shape, Topology.load(split_files[n_stages]).stage(0).file.parent, n_stages)


def test_shape_of_the_default_model(shape, default_model_path):
    reader = open_gguf(default_model_path)
    tensors = _tensor_bytes(reader)
    n_layer = field_value(reader, "llama.block_count")
    assert shape.n_layer == n_layer == len(shape.layer_bytes) == len(shape.layer_costs)
    assert shape.name == "SmolLM2-135M-Instruct.Q4_1"
    # the whole model, as one stage, holds every tensor once (tied: the embedding is also the LM head)
    assert "output.weight" not in tensors
    assert shape.weight_bytes(0, n_layer) == sum(tensors.values()) == shape.file_bytes(0, n_layer)
    assert shape.shared_bytes == tensors["token_embd.weight"]
    for i in (0, n_layer - 1):
        assert shape.layer_bytes[i] == sum(n for name, n in tensors.items() if name.startswith(f"blk.{i}."))
    # multiply-adds as the slicer's compute balance counts them
    costs, head = compute_costs(reader, n_layer)
    assert (list(shape.layer_costs), shape.head_cost) == (costs, head)
    # KV: K and V, f16, n_embd_k_gqa = head size x KV heads
    n_embd = field_value(reader, "llama.embedding_length")
    n_head = field_value(reader, "llama.attention.head_count")
    n_head_kv = field_value(reader, "llama.attention.head_count_kv")
    assert n_head_kv < n_head  # grouped-query attention: the formula must use the KV heads
    assert shape.kv_bytes_per_layer_token == 2 * (n_embd // n_head) * n_head_kv * 2
    assert shape.kv_bytes(0, 10, ctx=4096, lanes=4) == shape.kv_bytes_per_layer_token * 10 * 4096 * 4


def test_shape_of_an_untied_model_matches_its_split(small_tokenizer_fields, tmp_path):
    """A model with its own output.weight: only the final stage holds it, and no tensor is counted twice."""
    model = write_tiny_llama(tmp_path / "untied.gguf", tokenizer_from=small_tokenizer_fields, n_head=4,
                             n_head_kv=1)
    shape = model_shape(model)
    tensors = _tensor_bytes(open_gguf(model))
    assert "output.weight" in tensors and shape.shared_bytes == 0
    assert shape.weight_bytes(0, shape.n_layer) == sum(tensors.values())
    assert shape.kv_bytes_per_layer_token == 2 * (64 // 4) * 1 * 2
    split_model(model, "0:1,1:3,3:4", tmp_path / "split")
    _check_against_split(shape, tmp_path / "split", 3)


def test_a_stage_slice_or_a_bad_file_is_refused_clearly(small_tokenizer_fields, tmp_path):
    model = write_tiny_llama(tmp_path / "tiny.gguf", tokenizer_from=small_tokenizer_fields)
    split_model(model, "0:1,1:4", tmp_path / "split")
    with pytest.raises(PlanError, match=r"stage slice \(layers 1\.\.4 of 4\).*whole model"):
        model_shape(tmp_path / "split" / "stage-1.gguf")
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        model_shape(bad)


# --------------------------------------------------------------------------- the choice

# 12 even layers of 100 MiB; the head stage holds 50 MiB more, the final one 80 MiB and twice a layer's work.
UNIFORM = ModelShape(name="uniform", n_layer=12, layer_bytes=(100 * MIB,) * 12, first_bytes=50 * MIB,
                     last_bytes=80 * MIB, layer_costs=(10,) * 12, head_cost=20, kv_bytes_per_layer_token=0)
NO_MARGIN = {"margin_bytes": 0, "margin_fraction": 0.0}
WHOLE = 12 * 100 * MIB + 130 * MIB


def _host(name: str, mib: int, ms: float = 1.0) -> HostInfo:
    return HostInfo(name=name, memory_bytes=mib * MIB, ms_per_layer=ms)


def test_one_host_when_the_model_fits_on_one():
    plan = make_plan(UNIFORM, [_host("a", 10_000), _host("b", 10_000)], ctx=1, lanes=1, **NO_MARGIN)
    assert plan.ranges == [(0, 12)] and plan.hosts == ["a"]
    assert plan.stages[0].memory_bytes == WHOLE
    assert plan.ms_per_token == pytest.approx(12 + 2)  # 12 layers and a head worth 2, at 1 ms a layer


def test_the_fastest_host_that_fits_and_the_first_of_equals():
    hosts = [_host("small", 1_000, 0.5), _host("slow", 2_000, 2.0), _host("fast", 2_000, 1.0),
             _host("fast-too", 2_000, 1.0)]
    plan = make_plan(UNIFORM, hosts, ctx=1, lanes=1, **NO_MARGIN)
    assert plan.hosts == ["fast"] and plan.ranges == [(0, 12)]


def test_a_split_when_no_host_holds_it_in_the_fewest_stages():
    # each host holds ~60% of the model: two stages, not three
    hosts = [_host(f"h{i}", int(WHOLE / MIB * 0.6)) for i in range(4)]
    plan = make_plan(UNIFORM, hosts, ctx=1, lanes=1, **NO_MARGIN)
    assert len(plan.stages) == 2 and plan.hosts == ["h0", "h1"]
    # ~40%: three
    hosts = [_host(f"h{i}", int(WHOLE / MIB * 0.4)) for i in range(4)]
    plan = make_plan(UNIFORM, hosts, ctx=1, lanes=1, **NO_MARGIN)
    assert len(plan.stages) == 3
    for stage, host in zip(plan.stages, hosts):
        assert stage.memory_bytes <= host.memory_bytes
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 12
    assert all(a[1] == b[0] for a, b in zip(plan.ranges, plan.ranges[1:]))


def test_the_kv_cache_and_margins_count_against_memory(shape):
    """The default model: 30 layers, ~98 MB of weights; its KV cache at ctx 4096 x 4 lanes is 360 MiB."""
    ctx, lanes = 4096, 4
    whole = stage_memory(shape, 0, 30, ctx=ctx, lanes=lanes)
    weights_and_kv = shape.weight_bytes(0, 30) + shape.kv_bytes(0, 30, ctx=ctx, lanes=lanes)
    assert whole == 64 * MIB + -(-weights_and_kv * 11 // 10)
    one = [HostInfo("a:7390", whole, 1.0)]
    assert make_plan(shape, one, ctx=ctx, lanes=lanes).stages[0].memory_bytes == whole
    with pytest.raises(PlanRefused):
        make_plan(shape, [HostInfo("a:7390", whole - 1, 1.0)], ctx=ctx, lanes=lanes)
    # a smaller context fits where the larger did not
    assert make_plan(shape, [HostInfo("a:7390", whole - 1, 1.0)], ctx=ctx // 2, lanes=lanes).ranges == [(0, 30)]
    # two hosts with ~65% each: a split (its first stage with its boundary rows, 36 MiB here), every stage within
    # its host's memory
    two = [HostInfo("a:7390", int(whole * 0.65), 1.0), HostInfo("b:7390", int(whole * 0.65), 1.0)]
    plan = make_plan(shape, two, ctx=ctx, lanes=lanes)
    assert len(plan.stages) == 2
    assert all(s.memory_bytes <= int(whole * 0.65) for s in plan.stages)


def test_a_hosts_prefix_cache_counts_against_its_memory():
    """A host that holds the even share of the layers, but not that share plus its stage's prefix cache
    budget, gets a smaller share; the plan shows the cache in each stage's memory."""
    plain = [_host("a", 800), _host("b", 1200)]
    without = make_plan(UNIFORM, plain, ctx=1, lanes=1, **NO_MARGIN)
    layers = {s.host: s.layer_end - s.layer_start for s in without.stages}
    assert layers == {"a": 7, "b": 5} and without.stages[0].memory_bytes == 750 * MIB <= 800 * MIB
    cached = [HostInfo("a", 800 * MIB, 1.0, prefix_cache_bytes=256 * MIB), HostInfo("b", 1200 * MIB, 1.0)]
    plan = make_plan(UNIFORM, cached, ctx=1, lanes=1, **NO_MARGIN)
    share = {s.host: s for s in plan.stages}
    assert share["a"].layer_end - share["a"].layer_start < 7
    assert share["a"].prefix_cache_bytes == 256 * MIB and share["b"].prefix_cache_bytes == 0
    for stage, host in ((share["a"], cached[0]), (share["b"], cached[1])):
        weights = UNIFORM.weight_bytes(stage.layer_start, stage.layer_end)
        assert stage.memory_bytes == weights + host.prefix_cache_bytes <= host.memory_bytes
    assert plan.as_dict()["stages"][plan.hosts.index("a")]["prefix_cache_bytes"] == 256 * MIB
    # the ranges that fit without the cache are refused with it, naming it
    with pytest.raises(PlanRefused) as refused:
        place(UNIFORM, cached, [(0, 7), (7, 12)], ctx=1, lanes=1, **NO_MARGIN)
    assert "host a has 800 MiB for skippy; layers 0:7 need 1,006 MiB (its prefix cache's 256 MiB included): " \
           "206 MiB short" in str(refused.value)
    # and a host whose cache leaves no room for any stage is named as such
    with pytest.raises(PlanRefused) as refused:
        make_plan(UNIFORM, [HostInfo("a", 800 * MIB, 1.0, prefix_cache_bytes=800 * MIB), _host("b", 1200)],
                  ctx=1, lanes=1, stages=2, **NO_MARGIN)
    assert "host a has 800 MiB for skippy" in str(refused.value) and "prefix cache" in str(refused.value)


def _slowest(shape: ModelShape, ranges, speeds) -> float:
    mean = sum(shape.layer_costs) / shape.n_layer
    return max(ms * (sum(shape.layer_costs[a:b]) + (shape.head_cost if b == shape.n_layer else 0)) / mean
               for (a, b), ms in zip(ranges, speeds))


def test_a_slower_host_gets_fewer_layers(shape):
    speeds = [1.0, 2.0, 1.0]
    hosts = [HostInfo(f"10.77.0.{i + 2}:7390", 1 << 40, ms) for i, ms in enumerate(speeds)]
    plan = make_plan(shape, hosts, ctx=4096, lanes=4, stages=3)
    layers = {s.host: s.layer_end - s.layer_start for s in plan.stages}
    slow = hosts[1].name
    assert sorted(plan.hosts) == sorted(h.name for h in hosts)
    assert layers[slow] < min(n for host, n in layers.items() if host != slow)
    # the final stage also runs the LM head (worth ~8 layers here): not on the slow host, and with fewer
    # layers than the other fast one
    assert plan.hosts[-1] != slow
    assert plan.stages[-1].layer_end - plan.stages[-1].layer_start < max(layers.values())
    placed = [speeds[[h.name for h in hosts].index(name)] for name in plan.hosts]
    slowest = max(s.ms_per_token for s in plan.stages)
    assert slowest == pytest.approx(_slowest(shape, plan.ranges, placed))
    # better than the even split and the compute balance, on these hosts in the order given
    assert slowest <= _slowest(shape, balanced_ranges(shape.layer_costs, shape.head_cost, 3), speeds)
    assert slowest < _slowest(shape, plan_ranges(shape.n_layer, stages=3), speeds)
    # one token's trip: every stage, and a hop between each two
    plan = make_plan(shape, hosts, ctx=4096, lanes=4, stages=3, hop_ms=2.5)
    assert plan.ms_per_token == pytest.approx(sum(s.ms_per_token for s in plan.stages) + 2 * 2.5)


def test_forced_stages_name_the_host_that_cannot_hold_a_layer(shape):
    ctx, lanes = 4096, 4
    # one middle layer, its KV cache and boundary rows, or the last layer with the LM head
    smallest, what = min((stage_memory(shape, 10, 11, ctx=ctx, lanes=lanes), "1 layer"),
                         (stage_memory(shape, 29, 30, ctx=ctx, lanes=lanes), "1 layer + the LM head"))
    hosts = [HostInfo("10.77.0.2:7390", 1 << 40, 1.0), HostInfo("10.77.0.3:7390", 60 * MIB, 1.0),
             HostInfo("10.77.0.4:7390", 1 << 40, 1.0)]
    assert smallest > 60 * MIB
    with pytest.raises(PlanRefused) as refused:
        make_plan(shape, hosts, ctx=ctx, lanes=lanes, stages=3)
    message = str(refused.value)
    need = -(-smallest // MIB)
    assert "host 10.77.0.3:7390 has 60 MiB for skippy" in message
    assert f"the smallest stage it could run ({what}) needs {need} MiB: {need - 60} MiB short" in message
    assert "10.77.0.2" not in message and "10.77.0.4" not in message
    # with two stages, that host is not needed
    assert make_plan(shape, hosts, ctx=ctx, lanes=lanes, stages=2).hosts == ["10.77.0.2:7390", "10.77.0.4:7390"]


def test_too_little_memory_in_all_names_every_host(shape):
    hosts = [HostInfo("10.77.0.2:7390", 300 * MIB, 1.0), HostInfo("10.77.0.3:7390", 250 * MIB, 1.0)]
    with pytest.raises(PlanRefused) as refused:
        make_plan(shape, hosts, ctx=4096, lanes=4)
    message = str(refused.value)
    total = sum(stage_memory(shape, a, b, ctx=4096, lanes=4) for a, b in [(0, 15), (15, 30)])
    assert f"needs {-(-total // MIB)} MiB in all" in message
    assert "the hosts have 550 MiB (10.77.0.2:7390 300 MiB, 10.77.0.3:7390 250 MiB)" in message
    assert "SmolLM2-135M-Instruct.Q4_1" in message


def test_enough_memory_in_all_but_no_contiguous_split_says_so():
    # 1,340 MiB for a model of 1,330 (12 layers of 100, the 50 MiB embedding first, the 80 MiB head last): in
    # either order, the whole layers the first host holds leave the second more than it has
    hosts = [_host("a", 640), _host("b", 700)]
    with pytest.raises(PlanRefused, match="together enough, but no split"):
        make_plan(UNIFORM, hosts, ctx=1, lanes=1, **NO_MARGIN)


def test_deterministic_and_of_equals_the_order_given():
    hosts = [_host("c", 10), _host("d", 700, 1.0), _host("a", 700, 1.0), _host("b", 700, 1.0)]
    plans = [make_plan(UNIFORM, hosts, ctx=1, lanes=1, **NO_MARGIN) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    plan = plans[0]
    # "c" cannot hold half the model; of the equal others, the first two, in the order given (not by name)
    assert plan.hosts == ["d", "a"]
    assert plan.stages[0].layer_start == 0 and plan.stages[0].host == "d"
    assert [s.index for s in plan.stages] == [0, 1]
    assert make_plan(UNIFORM, hosts[::-1], ctx=1, lanes=1, **NO_MARGIN).hosts == ["b", "a"]


def test_the_hosts_go_in_the_order_that_is_fastest():
    """The final stage also runs the LM head: on a host much slower than the others it would be the slowest
    stage whatever it held, so the slow host goes where the stage is cheapest, given first or not."""
    shape = ModelShape(name="m", n_layer=12, layer_bytes=(MIB,) * 12, first_bytes=MIB, last_bytes=MIB,
                       layer_costs=(1,) * 12, head_cost=6, kv_bytes_per_layer_token=0)
    hosts = [_host("fast1", 1_000, 1.0), _host("fast2", 1_000, 1.0), _host("slow", 1_000, 4.0)]
    for given in (hosts, hosts[::-1], [hosts[2], hosts[0], hosts[1]]):
        plan = make_plan(shape, given, ctx=1, lanes=1, stages=3, **NO_MARGIN)
        assert plan.hosts[-1] != "slow"
        assert max(s.ms_per_token for s in plan.stages) < 4.0 * (1 + 6)  # the head on the slow host, one layer
        layers = {s.host: s.layer_end - s.layer_start for s in plan.stages}
        assert layers["slow"] <= min(layers["fast1"], layers["fast2"])
        assert layers["slow"] < max(layers["fast1"], layers["fast2"])


def test_as_dict_is_json_ready():
    plan = make_plan(UNIFORM, [_host("a:7390", 700), _host("b:7390", 700)], ctx=1, lanes=1, **NO_MARGIN)
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["model"] == "uniform" and data["ms_per_token"] == plan.ms_per_token
    first = data["stages"][0]
    assert set(first) == {"index", "host", "layers", "layer_start", "layer_end", "memory_bytes", "memory_mib",
                          "ms_per_token", "prefix_cache_bytes", "f16_below_mbps"}
    assert first["layers"] == [first["layer_start"], first["layer_end"]] == list(plan.ranges[0])
    assert first["memory_mib"] == round(first["memory_bytes"] / MIB, 1)
    assert isinstance(plan, DeployPlan)


@pytest.mark.parametrize(("kwargs", "hosts", "match"), [
    ({"stages": 3}, ["a", "b"], "3 stages need 3 hosts, 2 given"),
    ({"stages": 13}, [f"h{i}" for i in range(13)], "cannot split 12 layers into 13 stages"),
    ({"stages": 0}, ["a"], "at least 1"),
    ({}, [], "no hosts"),
    ({}, ["a", "a"], "host a is given twice"),
    ({"ctx": 0}, ["a"], "context must be at least 1"),
    ({"lanes": 0}, ["a"], "lanes must be at least 1"),
])
def test_bad_requests_get_a_clear_error(kwargs, hosts, match):
    args = {"ctx": 1, "lanes": 1, **kwargs}
    with pytest.raises(PlanError, match=match):
        make_plan(UNIFORM, [_host(h, 1_000) for h in hosts], **args)
    with pytest.raises(PlanError, match="ms per layer must be a positive number"):
        make_plan(UNIFORM, [HostInfo("a", MIB, 0.0)], ctx=1, lanes=1)


# --------------------------------------------------------------------------- against an exhaustive search


def _exhaustive(shape: ModelShape, hosts: list[HostInfo], *, ctx: int, lanes: int, stages: int | None,
                margins: dict) -> tuple[list[str], list[tuple[int, int]]] | None:
    """Every order of every host subset and every boundary set, compared exactly by the planner's rule."""
    n = shape.n_layer
    mean = Fraction(sum(shape.layer_costs), n)
    counts = [stages] if stages else range(1, min(len(hosts), n) + 1)
    for k in counts:
        best = None
        for subset in itertools.permutations(range(len(hosts)), k):
            for cuts in itertools.combinations(range(1, n), k - 1):
                bounds = (0, *cuts, n)
                ranges = list(zip(bounds[:-1], bounds[1:]))
                if any(stage_memory(shape, a, b, ctx=ctx, lanes=lanes, **margins) > hosts[h].memory_bytes
                       for h, (a, b) in zip(subset, ranges)):
                    continue
                ms = [Fraction(hosts[h].ms_per_layer)
                      * (sum(shape.layer_costs[a:b]) + (shape.head_cost if b == n else 0)) / mean
                      for h, (a, b) in zip(subset, ranges)]
                key = (max(ms), sum(ms), bounds[1:], subset)
                if best is None or key < best[0]:
                    best = (key, [hosts[h].name for h in subset], ranges)
        if best is not None:
            return best[1], best[2]
    return None


def test_the_choice_is_the_best_of_every_placement():
    rng = random.Random(7390)
    seen: dict[int | str, int] = {}
    for case in range(300):
        n = rng.randint(1, 8)
        shape = ModelShape(
            name="random", n_layer=n,
            layer_bytes=tuple(rng.choice((1, 2, 3)) * MIB for _ in range(n)),
            first_bytes=rng.randint(0, 3) * MIB, last_bytes=rng.randint(0, 3) * MIB,
            layer_costs=tuple(rng.choice((1, 2, 2, 3)) for _ in range(n)), head_cost=rng.randint(0, 4),
            kv_bytes_per_layer_token=rng.randint(0, 2) * 1024,
        )
        # few distinct speeds, so that ties (and their rules) come up often
        hosts = [HostInfo(f"h{i}", rng.randint(2, 10) * MIB, rng.choice((0.1, 0.1, 0.2, 0.3)))
                 for i in range(rng.randint(1, 5))]
        stages = rng.choice([None, None, rng.randint(1, min(n, len(hosts)))])
        margins = {"margin_bytes": rng.choice((0, MIB)), "margin_fraction": rng.choice((0.0, 0.1))}
        expected = _exhaustive(shape, hosts, ctx=256, lanes=2, stages=stages, margins=margins)
        try:
            plan = make_plan(shape, hosts, ctx=256, lanes=2, stages=stages, **margins)
        except PlanRefused:
            assert expected is None, f"case {case}: refused, but {expected} fits"
            seen["refused"] = seen.get("refused", 0) + 1
            continue
        assert expected is not None, f"case {case}: planned {plan}, but nothing fits"
        assert (plan.hosts, plan.ranges) == expected, f"case {case}"
        seen[len(plan.stages)] = seen.get(len(plan.stages), 0) + 1
    # the cases cover refusals and pipelines of one to four stages
    assert all(seen.get(k, 0) >= 5 for k in ("refused", 1, 2, 3)) and seen.get(4, 0) >= 1, seen


def test_given_ranges_are_placed_in_the_order_given_and_checked():
    hosts = [_host("a", 700, 1.0), _host("b", 700, 2.0), _host("c", 200, 1.0)]
    plan = place(UNIFORM, hosts, [(0, 6), (6, 12)], ctx=1, lanes=1, hop_ms=0.5, **NO_MARGIN)
    assert plan.hosts == ["a", "b"] and plan.ranges == [(0, 6), (6, 12)]
    assert [s.memory_bytes for s in plan.stages] == [650 * MIB, 680 * MIB]
    # a mean layer costs the host's ms per layer; the head is worth two layers here
    assert [s.ms_per_token for s in plan.stages] == [pytest.approx(6.0), pytest.approx(2.0 * 8)]
    assert plan.ms_per_token == pytest.approx(6.0 + 16.0 + 0.5)
    with pytest.raises(PlanRefused, match=r"host c has 200 MiB for skippy; layers 10:12 need 280 MiB: 80 MiB short"):
        place(UNIFORM, hosts, [(0, 5), (5, 10), (10, 12)], ctx=1, lanes=1, **NO_MARGIN)
    with pytest.raises(PlanError, match="must end at 12"):
        place(UNIFORM, hosts, [(0, 5), (5, 11)], ctx=1, lanes=1, **NO_MARGIN)
