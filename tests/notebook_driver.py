"""Drive examples/notebook.ipynb through a real Jupyter kernel (nbclient + ipykernel).

Run by tests/test_notebook.py in a process of its own (the kernel client's ZeroMQ sockets and
threads then never count against the test process's leak check):

    python -m tests.notebook_driver run OUT.ipynb       execute the notebook, write it with outputs
    python -m tests.notebook_driver interrupt OUT.json  interrupt a cell mid-epoch, run it again
    python -m tests.notebook_driver history OUT.json    a persistent loader shown as a cell's result

The kernel is this interpreter's own ipykernel, described by a kernel spec written to a temporary
folder: no kernel installed for the user or the system is needed or used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
import psutil
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
KERNEL = "aioloader-test-python"


def kernel_manager(spec_dir: Path) -> AsyncKernelManager:
    kernel_dir = spec_dir / "kernels" / KERNEL
    kernel_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "aioloader tests",
        "language": "python",
        # The kernel imports aioloader from this checkout.
        "env": {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        },
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir / "kernels")])
    return AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


def client(nb: Any, km: AsyncKernelManager, **kwargs: Any) -> NotebookClient:
    return NotebookClient(
        nb,
        km=km,
        kernel_name=KERNEL,
        timeout=240,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
        **kwargs,
    )


def worker_children(pid: int) -> list[int]:
    """The kernel's descendant processes, less multiprocessing's process-wide helpers."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "resource_tracker" in cmd or "multiprocessing.forkserver" in cmd:
            continue
        out.append(p.pid)
    return out


async def until(what: str, check: Any, limit: float = 60) -> Any:
    deadline = time.monotonic() + limit
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {limit} s")
        await asyncio.sleep(0.05)
    return value


def text_of(cell: Any) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif o.get("output_type") == "error":
            parts.append(f"{o.get('ename')}: {o.get('evalue')}")
    return "".join(parts)


async def run(out: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    with tempfile.TemporaryDirectory() as spec_dir:
        await client(nb, kernel_manager(Path(spec_dir))).async_execute()
    nbformat.write(nb, out)


async def interrupt(out: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as spec_dir:
        km = kernel_manager(Path(spec_dir))
        nc = client(nb, km, allow_errors=True)
        async with nc.async_setup_kernel():
            assert km.provisioner is not None
            kernel_pid = km.provisioner.pid  # type: ignore[attr-defined]
            report["kernel_pid"] = kernel_pid
            # The notebook's set-up cells: imports, the Dataset class, train().
            for i, cell in enumerate(nb.cells):
                if cell.cell_type == "code" and "await train(" not in cell.source:
                    if "plt." in cell.source or "losses[" in cell.source:
                        continue
                    await nc.async_execute_cell(cell, i)
                    assert "Error" not in text_of(cell), text_of(cell)
            # An epoch long enough to interrupt in its middle: 64 batches of 2 ms samples.
            slow = nbformat.v4.new_code_cell(
                "slow = await train('fork', epochs=1, dataset=NoisySine(n=4096, work_ms=2))"
            )
            nb.cells.append(slow)
            running = asyncio.ensure_future(nc.async_execute_cell(slow, len(nb.cells) - 1))
            progress = re.compile(r"\b([1-9]\d*)/64\b")
            await until("batches of the slow epoch", lambda: progress.search(text_of(slow)))
            report["workers_before_interrupt"] = len(worker_children(kernel_pid))
            await km.interrupt_kernel()
            await asyncio.wait_for(running, 60)
            report["interrupted_cell"] = text_of(slow)
            report["interrupted_error"] = [
                o.get("ename") for o in slow.outputs if o.get("output_type") == "error"
            ]
            with contextlib.suppress(TimeoutError):  # the count below tells
                await until(
                    "workers gone after the interrupt", lambda: not worker_children(kernel_pid), 30
                )
            report["workers_after_interrupt"] = len(worker_children(kernel_pid))
            # Run the cell again: the same loader code, a new epoch.
            again = nbformat.v4.new_code_cell(
                "again = await train('fork', epochs=1)\n"
                "print('batches after the interrupt:', len(again))"
            )
            nb.cells.append(again)
            await nc.async_execute_cell(again, len(nb.cells) - 1)
            report["rerun_cell"] = text_of(again)
            with contextlib.suppress(TimeoutError):  # the count below tells
                await until(
                    "workers gone after the re-run", lambda: not worker_children(kernel_pid), 30
                )
            report["workers_after_rerun"] = len(worker_children(kernel_pid))
            # Interrupted while its spawned workers are still starting (importing torch): the
            # kernel signals its whole process group, the workers included.
            starting = nbformat.v4.new_code_cell("await train('spawn', epochs=1)")
            nb.cells.append(starting)
            running = asyncio.ensure_future(nc.async_execute_cell(starting, len(nb.cells) - 1))
            await until("spawned workers", lambda: worker_children(kernel_pid), 60)
            await asyncio.sleep(0.1)
            await km.interrupt_kernel()
            await asyncio.wait_for(running, 60)
            report["startup_cell"] = text_of(starting)
            with contextlib.suppress(TimeoutError):  # the count below tells
                await until(
                    "workers gone after the start-up interrupt",
                    lambda: not worker_children(kernel_pid),
                    30,
                )
            report["workers_after_startup_interrupt"] = len(worker_children(kernel_pid))
    out.write_text(json.dumps(report, indent=1))  # noqa: ASYNC240 (the driver's last act)


HISTORY_CELLS = {
    "setup": (
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "from aioloader import AsyncDataLoader\n"
        "ds = TensorDataset(torch.arange(16.0))"
    ),
    # Iterated, then shown as the cell's result: Out[n] keeps it and its workers.
    "shown": (
        "loader = AsyncDataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)\n"
        "batches = [b async for b in loader]\n"
        "loader"
    ),
    # A cell ending with `;` keeps no result: no warning.
    "quiet": (
        "quiet = AsyncDataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)\nquiet;"
    ),
    "close": "await loader.aclose()\nawait quiet.aclose()\nprint('closed', loader, quiet)",
}


async def history(out: Path) -> None:
    nb = nbformat.v4.new_notebook()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as spec_dir:
        km = kernel_manager(Path(spec_dir))
        nc = client(nb, km, allow_errors=True)
        async with nc.async_setup_kernel():
            assert km.provisioner is not None
            kernel_pid = km.provisioner.pid  # type: ignore[attr-defined]
            report["kernel_pid"] = kernel_pid

            async def execute(name: str, source: str = "") -> Any:
                cell = nbformat.v4.new_code_cell(HISTORY_CELLS[source or name])
                nb.cells.append(cell)
                await asyncio.wait_for(nc.async_execute_cell(cell, len(nb.cells) - 1), 120)
                report[f"{name}_stderr"] = "".join(
                    o.get("text", "") for o in cell.outputs if o.get("name") == "stderr"
                )
                report[f"{name}_text"] = text_of(cell)
                return cell

            await execute("setup")
            await execute("shown")
            report["workers_shown"] = len(worker_children(kernel_pid))
            # Run the same cell again: the old loader's name now holds the new one.
            await execute("rerun", "shown")
            with contextlib.suppress(TimeoutError):  # the count below tells
                await until(
                    "the old loader's workers gone",
                    lambda: len(worker_children(kernel_pid)) <= 2,
                    30,
                )
            report["workers_rerun"] = len(worker_children(kernel_pid))
            await execute("quiet")
            await execute("close")
            with contextlib.suppress(TimeoutError):  # the count below tells
                await until("workers gone", lambda: not worker_children(kernel_pid), 30)
            report["workers_closed"] = len(worker_children(kernel_pid))
    out.write_text(json.dumps(report, indent=1))  # noqa: ASYNC240 (the driver's last act)


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    asyncio.run({"run": run, "interrupt": interrupt, "history": history}[mode](target))
