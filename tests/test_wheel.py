"""`pip wheel .` gives a wheel that carries libllama, ggml and the extension, and works from anywhere."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds and installs a wheel

REPO = Path(__file__).resolve().parent.parent


def test_wheel_ships_native_layer_and_runs_without_the_source_tree(tmp_path, default_model_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "-w", str(wheels), str(REPO)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = wheels.glob("skippy-*.whl")
    assert "linux" in wheel.name  # platform-specific, not a pure-Python wheel
    names = zipfile.ZipFile(wheel).namelist()
    for lib in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so", "libmtmd.so"):
        assert f"skippyd/_native/{lib}" in names
    assert any(n.startswith("skippyd/_native/_skippy_llama") and n.endswith(".so") for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import skippyd.runtime.llama as l;"
        "assert l.__file__.startswith(sys.argv[1]), l.__file__;"
        "m = l.Model(sys.argv[2]); print(m.n_layer, len(m.tokenize('hello world')))"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(target), str(default_model_path)], check=True,
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.split() == ["30", "2"]
    # the extension finds libllama beside itself ($ORIGIN), not in the build cache
    ext = next((target / "skippyd" / "_native").glob("_skippy_llama*.so"))
    ldd = subprocess.run(["ldd", str(ext)], capture_output=True, text=True).stdout
    assert str(target / "skippyd" / "_native" / "libllama.so") in ldd
