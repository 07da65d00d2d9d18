"""examples/service_fastapi.py as its users run it: uvicorn in a subprocess on a loopback port,
answering predictions while it trains, stopped with SIGTERM during an epoch and during the
loader's start-up."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.test_service import _get

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent


def _predict(base: str, x: list[float]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{base}/predict",
        data=json.dumps({"x": x}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def _start() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "service_fastapi.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the first line says where it listens
    assert line.startswith("serving on http://127.0.0.1:"), line
    return proc, line.split()[2]


def _stop_cleanly(proc: subprocess.Popen[str], workers: list[psutil.Process]) -> str:
    """SIGTERM; the lifespan's shutdown closes the loader; nothing is left behind."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    # uvicorn re-raises the signal once its shutdown is done: the process ends by SIGTERM.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "worker processes left: 0" in out, out
    assert "Traceback" not in out, out
    assert "leaked" not in out, out  # multiprocessing's resource_tracker: semaphores, shm
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive
    return out


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_fastapi_service_answers_while_it_trains_and_stops_on_sigterm() -> None:
    proc, base = _start()
    try:
        x = [float(i) / 16 for i in range(16)]
        answers = []
        deadline = time.monotonic() + 90
        status: dict[str, float] = {"version": 0}
        # Until the answers span a new snapshot too: under load, training may take its first
        # steps (versions 0 to 20) all between two requests.
        while (
            status["version"] < 20
            or len(answers) < 10
            or answers[-1]["version"] == answers[0]["version"]
        ):
            assert time.monotonic() < deadline, f"no training progress: {status}"
            try:
                answers.append(_predict(base, x))
                status = _get(f"{base}/status")
            except urllib.error.URLError as exc:
                if isinstance(exc, urllib.error.HTTPError):
                    raise
                time.sleep(0.1)  # uvicorn is not listening yet
        assert all(math.isfinite(a["y"]) for a in answers)
        versions = [a["version"] for a in answers]
        assert versions == sorted(versions) and versions[-1] > versions[0], versions
        with pytest.raises(urllib.error.HTTPError) as bad:
            _predict(base, [1.0, 2.0])
        assert bad.value.code == 400
        bad.value.close()
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2, workers  # the loader's workers (and the fork server)
        _stop_cleanly(proc, workers)
    finally:
        _kill(proc)


def test_fastapi_service_stopped_while_the_loader_starts_exits_cleanly() -> None:
    proc, _ = _start()
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "training started"
        # forkserver workers take a second or more to import torch: this lands in the start-up.
        workers = psutil.Process(proc.pid).children(recursive=True)
        out = _stop_cleanly(proc, workers)
        assert "stopped after 0 training steps" in out, out
    finally:
        _kill(proc)
