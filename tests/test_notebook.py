"""examples/notebook.ipynb executed by a real Jupyter kernel (nbclient + ipykernel), as a user
runs it; a cell interrupted in the middle of an epoch, then run again; a persistent loader
shown as a cell's result.

The kernel is driven from a process of its own (tests/notebook_driver.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest

from aioloader import AsyncDataLoader
from tests import datasets

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("tqdm")
pytest.importorskip("matplotlib")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
# A kernel start and three worker starts (spawn imports torch afresh) take a while on a busy
# machine: a longer limit than the suite's 120 s, still bounded.
pytestmark = pytest.mark.timeout(300)


def _drive(mode: str, out: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.notebook_driver", mode, str(out)],
        cwd=ROOT,
        env=dict(
            os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="module://matplotlib_inline.backend_inline"
        ),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _outputs(cell: Any, kind: str) -> list[Any]:
    return [o for o in cell.get("outputs", []) if o.get("output_type") == kind]


def test_notebook_runs_in_a_jupyter_kernel_under_every_start_method(tmp_path: Path) -> None:
    out = tmp_path / "executed.ipynb"
    _drive("run", out)
    nb = nbformat.read(out, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = [o for c in code for o in _outputs(c, "error")]
    assert not errors, errors
    stdout = "".join(
        o["text"] for c in code for o in _outputs(c, "stream") if o["name"] == "stdout"
    )
    stderr = "".join(
        o["text"] for c in code for o in _outputs(c, "stream") if o["name"] == "stderr"
    )
    for method in ("fork", "spawn", "forkserver"):
        assert f"{method}: 64 batches, final loss" in stdout, stdout
        # The progress bar: the right total (len(loader)) and both epochs run to the end.
        for epoch in (0, 1):
            assert f"{method} epoch {epoch}: 100%" in stderr and "32/32" in stderr, stderr[-2000:]
    assert "identical losses under fork, spawn and forkserver: True" in stdout, stdout
    # The loss went down (the model learned from the batches), in the printed final losses.
    final = [float(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if "final loss" in line]
    assert len(final) == 3 and all(v < 0.2 for v in final), final
    plots = [o for c in code for o in _outputs(c, "display_data") if "image/png" in o["data"]]
    assert len(plots) == 1


def test_interrupting_a_cell_mid_epoch_releases_the_workers_and_the_cell_runs_again(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.json"
    _drive("interrupt", out)
    report = json.loads(out.read_text())
    assert report["workers_before_interrupt"] >= 2, report
    # IPython turns the interrupt of a top-level await into the task's cancellation.
    assert report["interrupted_error"] in (["KeyboardInterrupt"], ["CancelledError"]), report
    assert "/64" in report["interrupted_cell"] and "64/64" not in report["interrupted_cell"]
    assert report["workers_after_interrupt"] == 0, report
    assert "batches after the interrupt: 32" in report["rerun_cell"], report
    assert report["workers_after_rerun"] == 0, report
    # Interrupted during the workers' start-up: the cell shows the interrupt and nothing of the
    # workers (which ignore the ^C that reached their process group).
    assert "Traceback" not in report["startup_cell"], report["startup_cell"]
    assert 'File "' not in report["startup_cell"], report["startup_cell"]
    assert report["workers_after_startup_interrupt"] == 0, report
    if psutil.pid_exists(report["kernel_pid"]):
        _, alive = psutil.wait_procs([psutil.Process(report["kernel_pid"])], timeout=10)
        assert not alive, "the kernel outlived its client"


def test_a_persistent_loader_shown_as_a_cells_result_warns_and_its_workers_end(
    tmp_path: Path,
) -> None:
    out = tmp_path / "report.json"
    _drive("history", out)
    report = json.loads(out.read_text())
    shown, rerun = report["shown_stderr"], report["rerun_stderr"]
    assert report["workers_shown"] == 2, report
    # The warning says what keeps the workers and how to release them, once.
    assert shown.count("UserWarning") == 1, shown
    assert "UserWarning: aioloader: Out[2] keeps this AsyncDataLoader alive" in shown, shown
    assert "`await loader.aclose()`" in shown, shown
    # The same cell run again: the new loader warns, and the old one, which only Out[2] held
    # once the name was given to the new one, is closed.
    assert "Out[3] keeps this AsyncDataLoader alive" in rerun, rerun
    assert "closed the AsyncDataLoader shown as Out[2]" in rerun, rerun
    assert report["workers_rerun"] == 2, report
    assert report["quiet_stderr"] == "", report["quiet_stderr"]
    assert "Error" not in report["close_text"], report["close_text"]
    assert report["workers_closed"] == 0, report
    if psutil.pid_exists(report["kernel_pid"]):
        _, alive = psutil.wait_procs([psutil.Process(report["kernel_pid"])], timeout=10)
        assert not alive, "the kernel outlived its client"


def test_a_loader_formatted_outside_a_cells_result_does_not_warn() -> None:
    from IPython.lib.pretty import pretty

    loader = AsyncDataLoader(datasets.RangeDataset(4), num_workers=2, persistent_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pretty(loader) == repr(loader)
        assert pretty([loader.sync()]) == f"[{loader.sync()!r}]"
