"""bench/opcount (bench/opcodes.py's counter, loaded into each daemon as sitecustomize): it counts a
function's bytecode instructions between SIGUSR1 and SIGUSR2, in proportion to the work, and only then."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PROGRAM = """
import os, signal, sys
def work(n):
    total = 0
    for i in range(n):
        total += i
    return total
def untraced(n):
    return sum(range(n))
n = int(sys.argv[1])
work(n)  # before SIGUSR1: not counted
os.kill(os.getpid(), signal.SIGUSR1)
work(n)
os.kill(os.getpid(), signal.SIGUSR2)
work(n)  # after SIGUSR2: not counted
"""


def counts(tmp_path: Path, n: int) -> dict[str, int]:
    env = {**os.environ, "SKIPPY_OPCOUNT_DIR": str(tmp_path), "PYTHONPATH": str(REPO / "bench" / "opcount")}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, str(n)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    (out,) = tmp_path.glob("ops-*.json")  # one file, named by the process's pid
    data = json.loads(out.read_text())
    out.unlink()
    return {name.split(" ")[-1]: count for name, count in data.items()}


def test_counts_the_signalled_window_in_proportion_to_the_work(tmp_path):
    small, large = counts(tmp_path, 1000), counts(tmp_path, 3000)
    # the loop body is a handful of instructions per iteration, counted once (one of the three calls)
    assert 3 * 1000 <= small["work"] <= 20 * 1000, small
    assert 2.8 <= large["work"] / small["work"] <= 3.2, (small, large)


def test_counts_nothing_without_its_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SKIPPY_OPCOUNT_DIR"}
    env["PYTHONPATH"] = str(REPO / "bench" / "opcount")
    probe = "import signal; print(signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)"
    proc = subprocess.run([sys.executable, "-c", probe],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stdout + proc.stderr
