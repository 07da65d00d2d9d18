"""A ^C sent to the whole process group (a terminal's Ctrl-C, a Jupyter kernel's interrupt) while
the workers are still starting: the main process gets its KeyboardInterrupt, and the workers exit
quietly, without a traceback each from the middle of their start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import asyncio, multiprocessing, os, signal, sys, threading, time
    from aioloader import AsyncDataLoader

    def interrupt_during_start_up():
        deadline = time.monotonic() + 60
        while not multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.05)  # the workers are importing torch now
        os.killpg(0, signal.SIGINT)

    async def main():
        async with AsyncDataLoader(
            list(range(64)), batch_size=4, num_workers=2, multiprocessing_context=sys.argv[1]
        ) as loader:
            async for _ in loader:
                await asyncio.sleep(0.01)
        print("finished without an interrupt", flush=True)

    if __name__ == "__main__":
        threading.Thread(target=interrupt_during_start_up, daemon=True).start()
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print("children left:", len(multiprocessing.active_children()), flush=True)
    """
)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_group_interrupt_during_worker_start_up_prints_no_worker_traceback(
    tmp_path: Path, method: str
) -> None:
    script = tmp_path / "interrupted.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), method],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,  # its own process group: the ^C reaches only it and its workers
    )
    assert proc.returncode == 0, proc.stderr
    assert "interrupted" in proc.stdout, proc.stdout + proc.stderr
    assert "children left: 0" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr
