"""The GGUF slicer and the topology file it writes (real files, no mocks)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippyd.runtime.architectures import Verdict, support
from skippyd.runtime.pypi import sha256_file
from skippyd.runtime.slicing import (
    TOPOLOGY_FILE,
    RangeError,
    SliceError,
    balanced_ranges,
    check_splittable,
    compute_costs,
    plan_ranges,
    split_model,
    stage_shares,
)
from skippyd.topology import StageSpec, Topology, TopologyError, parse_address, stage_addresses
from tests.tiny_model import MetadataField, write_tiny_llama

U32, I32, ARR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32, gguf.GGUFValueType.ARRAY


def values(reader: gguf.GGUFReader) -> dict:
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


# --- plan_ranges -------------------------------------------------------------


@pytest.mark.parametrize(
    "n_layer, stages, expected",
    [
        (30, 1, [(0, 30)]),
        (30, 2, [(0, 15), (15, 30)]),
        (30, 3, [(0, 10), (10, 20), (20, 30)]),
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_even_split(n_layer, stages, expected):
    assert plan_ranges(n_layer, stages=stages) == expected


@given(n_layer=st.integers(1, 300), data=st.data())
def test_even_split_covers_and_balances(n_layer, data):
    stages = data.draw(st.integers(1, n_layer))
    ranges = plan_ranges(n_layer, stages=stages)
    assert len(ranges) == stages
    assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [b - a for a, b in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_explicit_ranges():
    assert plan_ranges(30, ranges="0:10,10:20,20:30") == [(0, 10), (10, 20), (20, 30)]
    assert plan_ranges(30, ranges=" 0 : 29 , 29:30 ") == [(0, 29), (29, 30)]
    assert plan_ranges(30, ranges=[(0, 30)]) == [(0, 30)]


@pytest.mark.parametrize(
    "ranges, message",
    [
        ("0:10,12:30", "contiguous.*gap"),
        ("0:10,8:30", "contiguous.*overlap"),
        ("5:30", "start at layer 0"),
        ("0:10,10:20", "end at layer 20 but the model has 30"),
        ("0:10,10:40", "goes past the last layer"),
        ("0:10,10:10,10:30", "10:10 is empty"),
        ("0:10,20:10", "reversed"),
        ("0-10,10:30", "expected START:END"),
        ("a:b", "expected START:END"),
        ("0:10,", "expected START:END"),
        ("", "no layer ranges"),
        ("0:-1", "reversed|negative"),
    ],
)
def test_bad_ranges(ranges, message):
    with pytest.raises(RangeError, match=message):
        plan_ranges(30, ranges=ranges)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "either"),
        ({"stages": 2, "ranges": "0:30"}, "either"),
        ({"stages": 0}, "at least 1"),
        ({"stages": 31}, "at least one layer"),
    ],
)
def test_bad_stage_counts(kwargs, message):
    with pytest.raises(RangeError, match=message):
        plan_ranges(30, **kwargs)


def test_range_errors_are_slice_errors_and_value_errors():
    assert issubclass(RangeError, SliceError) and issubclass(SliceError, ValueError)


# --- architecture policy ----------------------------------------------------


@pytest.mark.parametrize("arch", ["bert", "t5", "mamba", "rwkv7", "jamba", "gemma3n", "wavtokenizer-dec"])
def test_refused_architectures_say_why_in_one_line(arch):
    reason = support(arch).reason
    assert support(arch).verdict is Verdict.REFUSED and reason and "\n" not in reason
    with pytest.raises(SliceError) as err:
        check_splittable({"general.architecture": arch, f"{arch}.block_count": 4})
    assert str(err.value) == f"cannot split architecture {arch!r}: {reason}"


def test_an_unknown_architecture_is_refused():
    with pytest.raises(SliceError, match="'grok-9'.*not an architecture of the pinned llama.cpp build"):
        check_splittable({"general.architecture": "grok-9"})


def test_layer_patterns_no_longer_refuse_a_model():
    # the stage loader reads them for the whole model and keeps its own layers'
    for key in ("gemma3.attention.sliding_window_pattern", "gemma3.attention.sliding_window"):
        assert check_splittable({"general.architecture": "gemma3", key: 6}) == "gemma3"
    assert check_splittable({"general.architecture": "deepseek2", "deepseek2.leading_dense_block_count": 3})


@pytest.mark.parametrize("arch, suffix, value, reason", [
    ("deepseek2", "nextn_predict_layers", 1, "next-token-prediction"),
    ("granite", "n_deepstack_layers", 2, "deepstack"),
    ("granite", "deepstack_mapping", [0, -1, 1], "deepstack"),
])
def test_variants_that_pass_more_than_the_residual_stream_are_refused(arch, suffix, value, reason):
    key = f"{arch}.{suffix}"
    with pytest.raises(SliceError, match=f"this {arch} model: it sets {re.escape(key)}.*{reason}"):
        check_splittable({"general.architecture": arch, key: value})
    assert check_splittable({"general.architecture": arch, f"{arch}.block_count": 4}) == arch


def test_mrope_sections_split_since_an_images_rows_carry_their_positions():
    assert check_splittable({"general.architecture": "glm4", "glm4.rope.dimension_sections": [8, 12, 12, 0]}) == "glm4"
    assert check_splittable({"general.architecture": "qwen2vl", "qwen2vl.rope.dimension_sections": [2, 3, 3, 0]})


def test_slice_and_shard_refused():
    with pytest.raises(SliceError, match="already a stage slice"):
        check_splittable({"general.architecture": "llama", "skippy.output": "hidden"})
    with pytest.raises(SliceError, match="shard"):
        check_splittable({"general.architecture": "llama", "split.count": 3})
    with pytest.raises(SliceError, match="no general.architecture"):
        check_splittable({})
    assert check_splittable({"general.architecture": "llama"}) == "llama"


def test_refused_file_writes_nothing(refused_model_path, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SliceError, match="'mamba'"):
        split_model(refused_model_path, None, out, stages=2)
    assert not out.exists() or not any(out.iterdir())


# --- splitting the tiny model ----------------------------------------------

PER_LAYER = "llama.test_per_layer"
NOT_PER_LAYER = "llama.test_other_array"
TINY_RANGES = [(0, 1), (1, 3), (3, 5)]


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory, small_tokenizer_fields) -> Path:
    """A 5-layer tiny llama with a per-layer array and an array that merely looks like one."""
    extra = [
        MetadataField(PER_LAYER, [10, 11, 12, 13, 14], ARR, I32),
        MetadataField(NOT_PER_LAYER, [1, 2, 3], ARR, I32),
    ]
    path = tmp_path_factory.mktemp("tiny-src") / "tiny5.gguf"
    # A non-default tensor alignment must be kept by the stage files.
    return write_tiny_llama(path, tokenizer_from=small_tokenizer_fields, n_layer=5, alignment=64, extra_metadata=extra)


@pytest.fixture(scope="module")
def tiny_split(tiny_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-split")
    seen = []
    topology = split_model(
        tiny_source, "0:1,1:3,3:5", out, progress=lambda done, total: seen.append((done, total))
    )
    source = gguf.GGUFReader(tiny_source)
    stages = [gguf.GGUFReader(s.file) for s in topology.stages]
    return topology, out, source, stages, seen


def test_split_writes_files_and_topology(tiny_source, tiny_split):
    topology, out, _, _, seen = tiny_split
    assert sorted(p.name for p in out.iterdir()) == ["stage-0.gguf", "stage-1.gguf", "stage-2.gguf", TOPOLOGY_FILE]
    assert topology.ranges == TINY_RANGES
    assert topology.n_layer == 5 and topology.n_embd == 64 and topology.n_vocab == 512
    assert topology.architecture == "llama" and topology.model_name == "tiny5"
    assert topology.source_sha256 == sha256_file(tiny_source)
    assert [s.output for s in topology.stages] == ["hidden", "hidden", "logits"]
    assert [s.address for s in topology.stages] == ["127.0.0.1:7400", "127.0.0.1:7401", "127.0.0.1:7402"]
    for stage in topology.stages:
        assert stage.sha256 == sha256_file(stage.file)  # hashed while writing, must match the file
    assert Topology.load(out / TOPOLOGY_FILE) == topology
    # progress: monotonic, ends at the total
    assert seen and seen[-1][0] == seen[-1][1]
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_split_metadata(tiny_split):
    topology, _, source, stages, _ = tiny_split
    src = values(source)
    for spec, reader in zip(topology.stages, stages):
        got = values(reader)
        a, b = spec.layer_start, spec.layer_end
        assert got["llama.block_count"] == b - a
        assert reader.fields["llama.block_count"].types == [U32]
        assert got["skippy.layer_start"] == a and got["skippy.layer_end"] == b
        assert got["skippy.n_layer_total"] == 5
        assert got["skippy.output"] == spec.output
        assert got["skippy.source_sha256"] == topology.source_sha256
        for key in ("skippy.layer_start", "skippy.layer_end", "skippy.n_layer_total"):
            assert reader.fields[key].types == [U32]
        assert got[PER_LAYER] == src[PER_LAYER]  # whole: the loader keeps its own layers' entries
        assert got[NOT_PER_LAYER] == src[NOT_PER_LAYER]
        assert reader.alignment == 64
        # every other key, tokenizer included, is copied unchanged with its type
        changed = {"llama.block_count"} | {k for k in got if k.startswith("skippy.")}
        assert {k: v for k, v in got.items() if k not in changed} == {k: v for k, v in src.items() if k not in changed}
        for key, field in source.fields.items():
            if key not in changed and not key.startswith("GGUF."):
                assert reader.fields[key].types == field.types, key


def test_split_tensors(tiny_split):
    topology, _, source, stages, _ = tiny_split
    src = {t.name: t for t in source.tensors}
    for spec, reader in zip(topology.stages, stages):
        a, b = spec.layer_start, spec.layer_end
        names = [t.name for t in reader.tensors]
        expected_blocks = {
            f"blk.{i - a}.{n.split('.', 2)[2]}" for i in range(a, b) for n in src if n.startswith(f"blk.{i}.")
        }
        assert {n for n in names if n.startswith("blk.")} == expected_blocks
        assert "token_embd.weight" in names and "output_norm.weight" in names
        assert ("output.weight" in names) == (spec.output == "logits")
        for t in reader.tensors:
            m = re.match(r"blk\.(\d+)\.(.+)", t.name)
            origin = src[f"blk.{int(m.group(1)) + a}.{m.group(2)}" if m else t.name]
            assert t.tensor_type == origin.tensor_type
            assert t.shape.tolist() == origin.shape.tolist()
            assert t.data.tobytes() == origin.data.tobytes(), t.name


def test_failed_split_leaves_no_partial_files(tiny_source, tmp_path):
    class Stop(Exception):
        pass

    def progress(done, total):
        if done > total // 2:
            raise Stop

    with pytest.raises(Stop):
        split_model(tiny_source, None, tmp_path, stages=2, progress=progress)
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert all(re.fullmatch(r"stage-\d+\.gguf", n) for n in leftovers), leftovers  # complete files only, no temp
    assert TOPOLOGY_FILE not in leftovers


def test_split_hosts_and_bad_requests(tiny_source, tmp_path):
    topology = split_model(tiny_source, "0:4,4:5", tmp_path / "a", hosts=["10.0.0.1:7500", "[::1]:7501"])
    assert [(s.host, s.port, s.address) for s in topology.stages] == [
        ("10.0.0.1", 7500, "10.0.0.1:7500"),
        ("::1", 7501, "[::1]:7501"),
    ]
    assert Topology.load(tmp_path / "a" / TOPOLOGY_FILE) == topology
    with pytest.raises(TopologyError, match="1 addresses given for 2 stages"):
        split_model(tiny_source, "0:4,4:5", tmp_path / "b", hosts=["h:1"])
    with pytest.raises(RangeError, match="has 5 layers"):
        split_model(tiny_source, "0:3", tmp_path / "c")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(SliceError, match="not a directory"):
        split_model(tiny_source, None, not_a_dir, stages=2)


# --- splitting the default model -------------------------------------------


# --- balancing by compute ------------------------------------------------------


@pytest.mark.parametrize(
    "costs, head, stages, expected",
    [
        ([1] * 30, 8, 2, [(0, 19), (19, 30)]),  # the default model's proportions (LM head ~ 8 layers)
        ([1] * 30, 0, 3, [(0, 10), (10, 20), (20, 30)]),  # no head: the even split
        ([1] * 6, 100, 3, [(0, 2), (2, 5), (5, 6)]),  # the head dominates: the final stage keeps one layer
        ([5, 1, 1, 1], 0, 2, [(0, 1), (1, 4)]),
        ([3], 2, 1, [(0, 1)]),
        ([1, 1, 1, 1], 9, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_balanced_ranges(costs, head, stages, expected):
    assert balanced_ranges(costs, head, stages) == expected


@given(costs=st.lists(st.integers(0, 50), min_size=1, max_size=12), head=st.integers(0, 200), data=st.data())
def test_balanced_ranges_are_a_best_split(costs, head, data):
    stages = data.draw(st.integers(1, len(costs)))
    ranges = balanced_ranges(costs, head, stages)
    assert len(ranges) == stages and ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(a < b for a, b in ranges) and all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))

    def worst(rs):
        loads = [sum(costs[a:b]) for a, b in rs]
        loads[-1] += head
        return max(loads)

    # no split into the same number of stages does better (all of them, by brute force)
    best = min(worst(list(zip((0, *cuts), (*cuts, len(costs)))))
               for cuts in itertools.combinations(range(1, len(costs)), stages - 1))
    assert worst(ranges) == best


def test_balanced_ranges_refuse_impossible_counts():
    with pytest.raises(RangeError, match="every stage needs at least one layer"):
        balanced_ranges([1, 1], 0, 3)
    with pytest.raises(RangeError):
        balanced_ranges([1, 1], 0, 0)


def test_compute_costs_and_shares_of_the_default_model(default_model_path):
    layers, head = compute_costs(gguf.GGUFReader(default_model_path), 30)
    # q, o 576x576; k, v 576x192; gate, up, down 576x1536 (the norms are not matrices)
    assert layers == [2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536] * 30
    assert head == 49152 * 576  # tied: the token embedding is the LM head
    assert stage_shares(layers, head, [(0, 15), (15, 30)]) == pytest.approx([0.395, 0.605], abs=1e-3)


def test_split_balanced_by_compute_and_its_bad_requests(tiny_source, tmp_path):
    planned = []
    topology = split_model(tiny_source, None, tmp_path / "a", stages=2, balance="compute",
                           on_plan=lambda ranges, shares: planned.append((ranges, shares)))
    (ranges, shares), = planned
    assert topology.ranges == ranges and abs(sum(shares) - 1) < 1e-9
    layers, head = compute_costs(gguf.GGUFReader(tiny_source), 5)
    assert ranges == balanced_ranges(layers, head, 2)
    with pytest.raises(RangeError, match="give a number of stages"):
        split_model(tiny_source, "0:4,4:5", tmp_path / "b", balance="compute")
    with pytest.raises(RangeError, match="balance must be one of"):
        split_model(tiny_source, None, tmp_path / "c", stages=2, balance="cost")


@pytest.fixture(scope="module")
def smol_split(default_model_path, tmp_path_factory):
    return split_model(default_model_path, "0:15,15:30", tmp_path_factory.mktemp("smol-split"))


def test_default_model_split(default_model_path, smol_split):
    assert smol_split.ranges == [(0, 15), (15, 30)]
    assert (smol_split.n_layer, smol_split.n_embd, smol_split.n_vocab) == (30, 576, 49152)
    source = gguf.GGUFReader(default_model_path)
    final = gguf.GGUFReader(smol_split.stages[1].file)
    assert len(final.tensors) == 137  # 15 layers x 9 + token_embd + output_norm (tied: no output.weight)
    assert values(final)["llama.block_count"] == 15
    assert values(final)["tokenizer.ggml.merges"] == values(source)["tokenizer.ggml.merges"]
    src = {t.name: t for t in source.tensors}
    for t in final.tensors:
        i, rest = (t.name.split(".", 2)[1:] if t.name.startswith("blk.") else (None, None))
        origin = src[f"blk.{int(i) + 15}.{rest}"] if i is not None else src[t.name]
        assert t.tensor_type == origin.tensor_type  # Q4_1 stays Q4_1, byte for byte
        assert np.array_equal(t.data, origin.data), t.name


# --- topology ----------------------------------------------------------------


def _topology(tmp_path: Path) -> Topology:
    stages = [
        StageSpec(0, tmp_path / "stage-0.gguf", "a" * 64, 0, 2, "127.0.0.1", 7400, "hidden"),
        StageSpec(1, tmp_path / "sub" / "stage-1.gguf", "b" * 64, 2, 4, "::1", 7401, "logits"),
    ]
    return Topology("my \"model\"", "c" * 64, 4, 64, 100, "llama", stages)


def test_topology_round_trip(tmp_path, monkeypatch):
    topology = _topology(tmp_path)
    path = tmp_path / "topology.toml"
    topology.dump(path)
    text = path.read_text()
    assert 'file = "stage-0.gguf"' in text and 'file = "sub/stage-1.gguf"' in text  # relative to the file
    monkeypatch.chdir("/")  # stage files resolve against the topology's directory, not the cwd
    assert Topology.load(path) == topology
    assert topology.stage(1).address == "[::1]:7401"
    with pytest.raises(TopologyError, match="no stage 2"):
        topology.stage(2)


def _dump_and_edit(tmp_path: Path, old: str, new: str) -> Path:
    path = tmp_path / "topology.toml"
    _topology(tmp_path).dump(path)
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("n_vocab = 100", "n_vocab = 100\ncolour = \"red\"", "colour: unknown key"),
        ("port = 7400", "port = 7400\nweight = 1", r"stages\[0\]\.weight: unknown key"),
        ("port = 7400", 'port = "7400"', r"stages\[0\]\.port: expected an integer"),
        ("port = 7400", "port = 70000", r"stages\[0\]\.port: expected an integer 1-65535"),
        ('output = "hidden"', 'output = "logits"', r"stages\[0\]\.output: the non-final stage"),
        ("layer_start = 2", "layer_start = 3", r"stages\[1\]\.layer_start: expected 2"),
        ("n_layer = 4", "n_layer = 5", "cover layers 0..4 but n_layer is 5"),
        ("n_embd = 64\n", "", "n_embd: missing"),
        ("version = 1", "version = 9", "unsupported topology version"),
        ('sha256 = "aaaa', 'sha256 = "zzzz', r"stages\[0\]\.sha256"),
        ("[[stages]]", "[[stages", "invalid TOML"),
    ],
)
def test_topology_errors_name_file_and_key(tmp_path, old, new, message):
    path = _dump_and_edit(tmp_path, old, new)
    with pytest.raises(TopologyError, match=message) as err:
        Topology.load(path)
    assert str(path) in str(err.value)


def test_topology_missing_file(tmp_path):
    with pytest.raises(TopologyError, match="no such file"):
        Topology.load(tmp_path / "nope.toml")


def test_addresses():
    assert stage_addresses(3) == [("127.0.0.1", 7400), ("127.0.0.1", 7401), ("127.0.0.1", 7402)]
    assert stage_addresses(2, base_port=9000, host="0.0.0.0") == [("0.0.0.0", 9000), ("0.0.0.0", 9001)]
    assert parse_address("[fe80::1]:80") == ("fe80::1", 80)
    assert parse_address(" node-2.lan:7400 ") == ("node-2.lan", 7400)
    for bad in ("node", "node:", ":7400", "node:0", "node:65536", "::1:7400", "a b:1"):
        with pytest.raises(TopologyError, match="bad address"):
            parse_address(bad)
    with pytest.raises(TopologyError, match="same HOST:PORT"):
        stage_addresses(2, ["h:1", "h:1"])
