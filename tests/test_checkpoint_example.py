"""examples/checkpoint_resume.py as its users run it: a training script SIGKILLed mid-epoch and
started again, twice, ends with the uninterrupted run's model, bit for bit."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "checkpoint_resume.py"


def _run(ckpt: Path, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--ckpt", str(ckpt), "--log", str(log), "--save-every", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return out


def _trained(log: Path) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> the batch's indices, the last time that step was trained."""
    steps: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        epoch, step, indices = line.split(" ", 2)
        steps[int(epoch), int(step)] = ast.literal_eval(indices)
    return steps


def _kill_after(proc: subprocess.Popen[str], log: Path, lines: int) -> None:
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().count("\n") >= lines):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the script made no progress"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def test_a_killed_training_script_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    whole_log = tmp_path / "whole.log"
    whole = _finish(_run(tmp_path / "whole.pt", whole_log))

    ckpt, log = tmp_path / "run.pt", tmp_path / "run.log"
    # Killed in the first epoch (between checkpoints) and again in the second; 32 steps an epoch.
    for lines in (13, 45):
        _kill_after(_run(ckpt, log), log, lines)
    resumed = _finish(_run(ckpt, log))

    assert "starting at epoch 1, batch" in resumed  # where the second kill left it
    # Every step, as last trained, saw the uninterrupted run's batch; the final weights match.
    assert _trained(log) == _trained(whole_log)
    assert resumed.splitlines()[-1] == whole.splitlines()[-1]
