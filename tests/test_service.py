"""examples/service.py as its users run it: a subprocess on a loopback port, answering
predictions while it trains, stopped with SIGTERM."""

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

pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parent.parent


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return dict(json.loads(r.read()))


def _predict(base: str, x: list[float]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{base}/predict", data=json.dumps({"x": x}).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


@pytest.mark.parametrize(
    "loader",
    ["aioloader", pytest.param("torch", marks=pytest.mark.slow)],  # torch: the baseline
)
def test_service_answers_while_it_trains_and_stops_cleanly_on_sigterm(loader: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "service.py"), "--port", "0", "--loader", loader],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,
    )
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()  # the first line says where it listens
        assert line.startswith("serving on http://127.0.0.1:"), line
        base = line.split()[2]

        # Training progresses while requests are answered.
        x = [float(i) / 16 for i in range(16)]
        answers = []
        deadline = time.monotonic() + 60
        status = _get(f"{base}/status")
        # Until the answers span a new snapshot too: under load, training may take its first
        # steps (versions 0 to 20) all between two requests.
        while (
            status["version"] < 20
            or len(answers) < 10
            or answers[-1]["version"] == answers[0]["version"]
        ):
            assert time.monotonic() < deadline, f"no training progress: {status}"
            answers.append(_predict(base, x))
            status = _get(f"{base}/status")
        assert all(isinstance(a["y"], float) and math.isfinite(a["y"]) for a in answers)
        assert status["steps"] >= 20 and math.isfinite(status["loss"])
        # The answers come from snapshots that training replaced as it went on.
        versions = [a["version"] for a in answers]
        assert versions == sorted(versions) and versions[-1] > versions[0], versions

        with pytest.raises(urllib.error.HTTPError) as bad:
            _predict(base, [1.0, 2.0])
        assert bad.value.code == 400
        bad.value.close()

        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len(workers) >= 2, workers  # the loader's worker processes
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    assert "worker processes left: 0" in out, out
    assert "Traceback" not in out, out
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, alive
