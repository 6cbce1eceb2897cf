"""`skippyctl model ...` through typer's CliRunner (real files, no mocks)."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from skippyctl.app import DEFAULT_URL, Globals, app
from skippyd.topology import Topology


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(app, [str(a) for a in args])

    return invoke


def assert_clean_error(result, code: int, *fragments: str) -> None:
    """Exit code, one "error:" line on stderr, nothing on stdout, no traceback."""
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    assert result.stderr.startswith("error: ")
    for fragment in fragments:
        assert fragment in result.stderr
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_split_json(run, tiny_model_small_vocab_path, tmp_path):
    out = tmp_path / "out"
    result = run(
        "model", "split", tiny_model_small_vocab_path, "--ranges", "0:1,1:4", "--out", out,
        "--hosts", "10.0.0.1:7500,[::1]:7501", "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["n_layer"] == 4 and data["architecture"] == "llama"
    assert [(s["layer_start"], s["layer_end"], s["output"]) for s in data["stages"]] == [
        (0, 1, "hidden"),
        (1, 4, "logits"),
    ]
    assert [(s["host"], s["port"]) for s in data["stages"]] == [("10.0.0.1", 7500), ("::1", 7501)]
    assert all(s["size"] > 0 for s in data["stages"])
    topology = Topology.load(data["topology"])
    assert topology.as_dict() == {k: v for k, v in data.items() if k != "topology"} | {
        "stages": [{k: v for k, v in s.items() if k not in ("size", "compute_share")} for s in data["stages"]]
    }
    shares = [s["compute_share"] for s in data["stages"]]
    assert abs(sum(shares) - 1) < 1e-3 and shares[1] > 3 * shares[0]  # 3 layers and the LM head against 1


def test_split_balanced_by_compute(run, default_model_path, tmp_path):
    """The default model's LM head weighs as much as 8 of its layers: an even split leaves 60% of the work
    on the last stage, a compute-balanced one gives it 11 layers of 30 and half the work."""
    even = json.loads(run("model", "split", default_model_path, "-n", "2", "--out", tmp_path / "a", "--json").stdout)
    assert [(s["layer_start"], s["layer_end"]) for s in even["stages"]] == [(0, 15), (15, 30)]
    assert [s["compute_share"] for s in even["stages"]] == pytest.approx([0.395, 0.605], abs=1e-3)
    result = run("model", "split", default_model_path, "-n", "2", "--balance", "compute", "--out", tmp_path / "b")
    assert result.exit_code == 0, result.output
    for text in ("0:19", "19:30", "50%"):
        assert text in result.stdout
    assert Topology.load(tmp_path / "b" / "topology.toml").ranges == [(0, 19), (19, 30)]


def test_split_table(run, tiny_model_small_vocab_path, tmp_path):
    result = run("model", "split", tiny_model_small_vocab_path, "--stages", "2", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    for text in ("stage-0.gguf", "stage-1.gguf", "0:2", "2:4", "hidden", "logits", "127.0.0.1:7401"):
        assert text in result.stdout
    assert (tmp_path / "topology.toml").exists()
    # LAN addresses keep their ports in the 80 columns of a pipe
    result = run("model", "split", tiny_model_small_vocab_path, "--stages", "2", "--out", tmp_path / "lan",
                 "--hosts", "192.168.100.200:7400,192.168.100.201:7401")
    assert result.exit_code == 0, result.output
    assert "192.168.100.200:7400" in result.stdout and "192.168.100.201:7401" in result.stdout, result.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((), "exactly one of --stages"),
        (("--stages", "2", "--ranges", "0:4"), "exactly one of --stages"),
        (("--ranges", "0-2,2:4"), "expected START:END"),
        (("--ranges", "0:2,3:4"), "contiguous"),
        (("--ranges", "0:2"), "has 4 layers"),
        (("--stages", "9"), "cannot split 4 layers into 9 stages"),
        (("--stages", "2", "--hosts", "a:1"), "1 addresses given for 2 stages"),
        (("--stages", "2", "--hosts", "a:1,b"), "bad address 'b'"),
        (("--ranges", "0:2,2:4", "--balance", "compute"), "does not apply to --ranges"),
    ],
)
def test_split_usage_errors(run, tiny_model_small_vocab_path, tmp_path, args, fragment):
    result = run("model", "split", tiny_model_small_vocab_path, "--out", tmp_path / "out", *args)
    assert_clean_error(result, 2, fragment)
    assert not (tmp_path / "out" / "topology.toml").exists()


def test_split_unknown_balance_is_refused_by_the_option_parser(run, tiny_model_small_vocab_path, tmp_path):
    result = run("model", "split", tiny_model_small_vocab_path, "-n", "2", "--balance", "cost", "--out", tmp_path)
    assert result.exit_code == 2 and "'layers'" in result.stderr and "'compute'" in result.stderr
    assert not (tmp_path / "topology.toml").exists()


def test_architectures_lists_every_verdict(run):
    result = run("model", "architectures", "--json")
    assert result.exit_code == 0
    rows = {r["architecture"]: r for r in json.loads(result.stdout)}
    assert rows["gemma3"] == {"architecture": "gemma3", "verdict": "splits (verified by test)", "reason": None}
    assert rows["mamba"]["verdict"] == "refused" and "rolled back" in rows["mamba"]["reason"]
    table = run("model", "architectures").stdout
    assert "gemma3" in table and "splits (verified by test)" in table and "refused" in table


def test_fetch_lists_the_models_it_knows(run):
    result = run("model", "fetch", "--list", "--json")
    assert result.exit_code == 0
    names = [r["name"] for r in json.loads(result.stdout)]
    assert names == ["smollm2-135m", "gemma3-270m"]
    bad = run("model", "fetch", "no-such-model")
    assert bad.exit_code == 2 and "no-such-model" in bad.stderr


def test_split_refuses_a_recurrent_model(run, refused_model_path, tmp_path):
    result = run("model", "split", refused_model_path, "--stages", "2", "--out", tmp_path)
    assert_clean_error(result, 1, "cannot split architecture 'mamba'", "rolled back")


def test_split_missing_and_bad_files(run, tmp_path):
    result = run("model", "split", tmp_path / "nope.gguf", "--stages", "2", "--out", tmp_path / "o")
    assert_clean_error(result, 1, "no such file")
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    result = run("model", "split", bad, "--stages", "2", "--out", tmp_path / "o")
    assert_clean_error(result, 1, "not a GGUF file")


def test_inspect_table_and_json(run, tiny_model_small_vocab_path):
    result = run("model", "inspect", tiny_model_small_vocab_path)
    assert result.exit_code == 0, result.output
    for text in ("architecture", "llama", "layers", "F16", "splittable"):
        assert text in result.stdout
    assert str(tiny_model_small_vocab_path) in result.stdout, result.stdout  # the title, not broken mid-name
    result = run("model", "inspect", tiny_model_small_vocab_path, "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["architecture"], info["n_layer"], info["n_vocab"]) == ("llama", 4, 512)
    assert info["file_type"] == "F16" and info["splittable"] is True


def test_inspect_shows_brackets_as_written(run, tiny_model_small_vocab_path, tmp_path):
    """A path with brackets is shown word for word, not taken for rich markup (which would drop "[bold]")."""
    odd = tmp_path / "[bold]m.gguf"
    odd.write_bytes(tiny_model_small_vocab_path.read_bytes())
    result = run("model", "inspect", odd)
    assert result.exit_code == 0, result.output
    assert "[bold]m.gguf" in result.stdout, result.stdout


def test_inspect_errors(run, tiny_model_small_vocab_path, tmp_path):
    assert_clean_error(run("model", "inspect", tmp_path / "nope.gguf"), 1, "no such file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model_small_vocab_path.read_bytes()[:50_000])
    assert_clean_error(run("model", "inspect", cut, "--json"), 1, "truncated")


def test_fetch(run, default_model_path):
    result = run("model", "fetch")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{default_model_path}\n"
    result = run("model", "fetch", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["path"] == str(default_model_path) and data["size"] == 98_362_432


def test_global_options_reach_commands():
    """The callback stores --url/--token-file in ctx.obj for every noun."""
    seen = []
    probe = typer.Typer()

    @probe.command()
    def show(ctx: typer.Context) -> None:
        seen.append(ctx.obj)

    app.add_typer(probe, name="probe-test")
    try:
        runner = CliRunner()
        assert runner.invoke(app, ["probe-test", "show"]).exit_code == 0
        assert runner.invoke(app, ["--url", "ws://h:1", "--token-file", "/t", "probe-test", "show"]).exit_code == 0
    finally:
        app.registered_groups[:] = [g for g in app.registered_groups if g.name != "probe-test"]
    assert seen[0] == Globals(url=DEFAULT_URL, token_file=None)
    assert seen[1].url == "ws://h:1" and str(seen[1].token_file) == "/t"


def test_no_args_shows_help(run):
    result = run("model")
    assert "split" in result.output and "inspect" in result.output and "fetch" in result.output
