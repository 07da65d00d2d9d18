"""Checks of aioloader/_procpool.py that need no torch: run with any Python >= 3.11.

    python tests/procpool_check.py [SCENARIO ...] [--old-order]

The module is loaded by path (the aioloader package imports torch), so the parts that rely on
CPython's private executor internals are exercised under every interpreter available, 3.12 and
3.13 included. Prints one line per scenario, ``<name>: ok ...`` or ``<name>: FAIL ...``, and
exits 1 if any failed. tests/test_executor.py runs it under each Python it finds.

``--old-order`` runs ``kill_after_crash`` with the order aioloader used before (``shutdown()``
first, then SIGKILL), to show the scenario reproduces the hang on Python >= 3.12.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib.util
import logging.handlers
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

#: How long a step may block before the scenario counts as hung.
HANG_S = 4.0


def load_procpool() -> ModuleType:
    # A stand-in package over aioloader's folder: _procpool's relative imports (_ahead, torch-free
    # like it) resolve there, and the real package's __init__ (which imports torch) never runs.
    folder = Path(__file__).resolve().parents[1] / "aioloader"
    package = ModuleType("aioloader_procpool_check")
    package.__path__ = [str(folder)]
    sys.modules[package.__name__] = package
    spec = importlib.util.spec_from_file_location(
        f"{package.__name__}._procpool", folder / "_procpool.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- run in the worker processes


def ignore_sigterm() -> None:
    # What user code may do in a worker (a "graceful shutdown" handler): SIGTERM no longer ends it.
    signal.signal(signal.SIGTERM, lambda *_: None)


def nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


# ------------------------------------------------------------------------------------ helpers


def within(seconds: float, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run ``fn`` on a daemon thread: (finished in time, its result or exception)."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return (not t.is_alive(), out[0] if out else None)


def sigkill_all(procs: list[Any]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(p.pid, signal.SIGKILL)


def broken_pool(pp: ModuleType, ctx: Any, grace: float | None) -> tuple[Any, list[Any]]:
    """A two-worker pool whose manager thread is terminating it after one worker died, with the
    survivor ignoring SIGTERM. On Python >= 3.12 the thread now holds the shutdown lock, for good
    with ``grace`` None (CPython's own behaviour), else until it SIGKILLs the survivor."""
    ex = pp.Executor(2, mp_context=ctx, initializer=ignore_sigterm, sigterm_grace=grace)
    ex.start_workers()
    procs = ex.processes()
    # Every worker initialised (SIGTERM handler in place) before the crash.
    futs = [ex.submit(nap, 0.2) for _ in range(4)]
    for f in futs:
        f.result(timeout=30)
    ex.submit(nap, 60)
    ex.submit(nap, 60)
    time.sleep(0.3)
    os.kill(procs[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not ex._broken and time.monotonic() < deadline:
        time.sleep(0.001)
    if grace is None:
        time.sleep(0.2)  # the manager thread is joining the survivor now
    return ex, procs


# ---------------------------------------------------------------------------------- scenarios


def kill_after_crash(pp: ModuleType, old_order: bool) -> str:
    """Stopping a pool whose manager thread holds the lock without end (as CPython's does)."""
    ctx = multiprocessing.get_context("fork")
    ex, procs = broken_pool(pp, ctx, None)
    manager = ex._executor_manager_thread
    queues = [ex._result_queue]

    def stop() -> None:
        if old_order:  # what WorkerPool._kill_sync did before: shutdown() first
            ex.shutdown(wait=False, cancel_futures=True)
        pp.kill_executors([ex], procs, [manager], queues, 5.0)

    t0 = time.perf_counter()
    done, err = within(HANG_S, stop)
    if not done:
        sigkill_all(procs)
        within(HANG_S, lambda: manager.join())
        return f"HANG: stopping blocked for more than {HANG_S:.0f} s"
    if isinstance(err, BaseException):
        return f"FAIL: {err!r}"
    alive = [p.pid for p in procs if p.is_alive()]
    if alive or manager.is_alive():
        return f"FAIL: left alive: processes {alive}, manager thread {manager.is_alive()}"
    return f"ok: stopped in {time.perf_counter() - t0:.2f}s"


def graceful_after_crash(pp: ModuleType) -> str:
    """request_shutdown() on a pool being torn down gives up at once instead of blocking."""
    ctx = multiprocessing.get_context("fork")
    ex, procs = broken_pool(pp, ctx, None)
    manager = ex._executor_manager_thread
    t0 = time.perf_counter()
    done, asked = within(HANG_S, lambda: ex.request_shutdown(time.monotonic() + 30))
    took = time.perf_counter() - t0
    if not done:
        sigkill_all(procs)
        within(HANG_S, lambda: manager.join())
        return f"HANG: request_shutdown blocked for more than {HANG_S:.0f} s"
    pp.kill_executors([ex], procs, [manager], [ex._result_queue], 5.0)
    if asked is not False or took > 1.0:
        return f"FAIL: request_shutdown returned {asked!r} after {took:.2f}s"
    if any(p.is_alive() for p in procs) or manager.is_alive():
        return "FAIL: something left alive"
    return f"ok: gave up after {took:.2f}s"


def submit_after_crash(pp: ModuleType) -> str:
    """A submit racing the manager thread's teardown (the event loop's scheduler, before it saw
    the crash) fails with BrokenProcessPool instead of waiting without end for the lock."""
    ctx = multiprocessing.get_context("fork")
    ex, procs = broken_pool(pp, ctx, pp.SIGTERM_GRACE_S)
    manager = ex._executor_manager_thread
    t0 = time.perf_counter()
    done, err = within(HANG_S, lambda: ex.submit(nap, 0))
    took = time.perf_counter() - t0
    if not done:
        sigkill_all(procs)
        within(HANG_S, lambda: manager.join())
        return f"HANG: submit blocked for more than {HANG_S:.0f} s"
    manager.join(HANG_S)
    killed = set(ex.killed_pids)
    pp.kill_executors([ex], procs, [manager], [ex._result_queue], 5.0)
    if type(err).__name__ != "BrokenProcessPool":
        return f"FAIL: submit gave {err!r}"
    # Only >= 3.12 holds the lock while joining; there the survivor is SIGKILLed and named.
    expect = {procs[1].pid} if sys.version_info >= (3, 12) else set()
    if killed != expect or (expect and procs[1].exitcode != -9):
        return f"FAIL: killed_pids {killed}, expected {expect}; exit codes {procs[1].exitcode}"
    return f"ok: BrokenProcessPool after {took:.2f}s; SIGKILLed by the manager: {len(killed)}"


def graceful_idle(pp: ModuleType) -> str:
    """An idle healthy pool: the workers are asked to exit and exit by themselves."""
    ex = pp.Executor(2, mp_context=multiprocessing.get_context("spawn"))
    ex.start_workers()
    procs = ex.processes()
    ex.submit(nap, 0).result(timeout=30)
    manager = ex._executor_manager_thread
    queues = [ex._result_queue]
    if not ex.request_shutdown(time.monotonic() + 5):
        return "FAIL: request_shutdown refused a healthy pool"
    deadline = time.monotonic() + 30
    # Polled: the manager thread reaps them too, and exitcode reads None for a moment in the
    # thread whose waitpid() lost that race (ECHILD).
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    codes = [p.exitcode for p in procs]
    pp.kill_executors([ex], procs, [manager], queues, 5.0)
    if codes != [0, 0]:
        return f"FAIL: exit codes {codes} (expected the workers to exit by themselves)"
    if manager.is_alive():
        return "FAIL: manager thread alive"
    return "ok"


def start_all(pp: ModuleType, method: str) -> str:
    """Every process starts in start_workers(), on its thread; submits never start another."""
    starts: list[str] = []

    class Spy(pp.Executor):  # type: ignore[name-defined,misc]
        def _spawn_process(self) -> None:
            starts.append(threading.current_thread().name)
            super()._spawn_process()

    n = 3
    ex = Spy(n, mp_context=multiprocessing.get_context(method))
    t = threading.Thread(target=ex.start_workers, name="starter")
    t.start()
    t.join(60)
    started = {p.pid for p in ex.processes()}
    # Submitted from this thread (the event loop's, in aioloader), more tasks than workers.
    pids = {f.result(timeout=60) for f in [ex.submit(nap, 0.05) for _ in range(3 * n)]}
    after = {p.pid for p in ex.processes()}
    procs, manager, queues = ex.processes(), ex._executor_manager_thread, [ex._result_queue]
    pp.kill_executors([ex], procs, [manager], queues, 5.0)
    if starts != ["starter"] * n or len(started) != n:
        return f"FAIL: starts on threads {starts}, {len(started)} processes after start_workers"
    if after != started or not pids <= started:
        return f"FAIL: processes changed: {sorted(started)} -> {sorted(after)}, used {sorted(pids)}"
    return f"ok: {n} processes started on the start-up thread, none later"


def staggered(pp: ModuleType) -> str:
    """start_workers(1) then grow(): tasks queued meanwhile all run; no process starts on the
    submitting thread. An executor never started takes tasks, then close_unstarted() cancels
    them and closes its pipes."""
    ctx = multiprocessing.get_context("forkserver")
    ex = pp.Executor(3, mp_context=ctx)
    ex.start_workers(1)
    if len(ex.processes()) != 1:
        return f"FAIL: {len(ex.processes())} processes after start_workers(1)"
    futs = [ex.submit(nap, 0.05) for _ in range(6)]
    if len(ex.processes()) != 1:
        return "FAIL: submit() started a process"
    ok, grown = within(60, ex.grow)
    if not ok or not grown:
        return f"FAIL: grow() -> {grown!r}"
    ok, pids = within(60, lambda: {f.result() for f in futs})
    procs = ex.processes()
    pp.kill_executors([ex], procs, [ex._executor_manager_thread], [ex._result_queue], 5)
    if not ok or len(procs) != 3:
        return f"FAIL: results {pids!r}, {len(procs)} processes"
    fds_before = set(os.listdir("/proc/self/fd"))
    idle = pp.Executor(1, mp_context=ctx)
    queued = idle.submit(nap, 0)
    pp.kill_executors([idle], [], [], [idle._result_queue], 5)
    left = set(os.listdir("/proc/self/fd")) - fds_before
    if not queued.cancelled() or idle.processes():
        return "FAIL: the unstarted executor's task was not cancelled"
    if left:
        return f"FAIL: fds left open by an unstarted executor: {sorted(left)}"
    return f"ok: {len(pids)} worker pids served the queued tasks"


def fork_warning(pp: ModuleType) -> str:
    """No multi-threaded fork() warning from our starts; the warning filters are left as found."""
    ctx = multiprocessing.get_context("fork")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # the process is multi-threaded, as with a loop
    other.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = list(warnings.filters)
            # Control: a plain executor started the same way does warn on Python >= 3.12.
            plain = pp.ProcessPoolExecutor(1, mp_context=ctx)
            within(60, lambda: plain.submit(nap, 0).result())
            plain.shutdown()
            control = [w for w in caught if "multi-threaded" in str(w.message)]
            caught.clear()
            ex = pp.Executor(2, mp_context=ctx)
            within(60, ex.start_workers)
            ours = [str(w.message) for w in caught if "multi-threaded" in str(w.message)]
            after = list(warnings.filters)
            procs = ex.processes()
            pp.kill_executors([ex], procs, [ex._executor_manager_thread], [ex._result_queue], 5)
    finally:
        stop.set()
        other.join()
    if ours:
        return f"FAIL: our start warned: {ours}"
    if after != before:
        return "FAIL: the warning filters changed"
    expect = sys.version_info >= (3, 12)
    if bool(control) != expect:
        return f"FAIL: control warned={bool(control)}, expected {expect}"
    return f"ok: control warned={bool(control)}, ours did not"


def launch_retry(pp: ModuleType) -> str:
    """A forkserver worker killed between its fork and its parent's hand-over of its start-up
    data is started again; the dead launch's pipes are closed at once (not by a later garbage
    collection); a run of such deaths ends in LaunchError."""
    import multiprocessing.forkserver as fs

    original = fs.connect_to_new_process
    doomed: set[int] | None = {1}
    launches = 0
    dead_pipes: set[str] = set()  # "pipe:[inode]" of the dead launches' ends

    def killing(fds: Any) -> Any:
        nonlocal launches
        server = fs._forkserver._forkserver_pid
        before = _children_of(server)
        ends = original(fds)
        launches += 1
        if doomed is None or launches in doomed:
            dead_pipes.update(os.readlink(f"/proc/self/fd/{fd}") for fd in ends)
            deadline = time.monotonic() + HANG_S
            while not (new := _children_of(server) - before):
                if time.monotonic() > deadline:
                    raise AssertionError("the fork server forked nothing")
                time.sleep(0.001)
            pid = min(new)
            os.kill(pid, signal.SIGKILL)
            while pid in _children_of(server) and time.monotonic() < deadline:
                time.sleep(0.001)  # reaped by the fork server
            time.sleep(0.05)  # which closes its copy of the pipe's read end after the fork
        return ends

    def open_dead_pipes() -> set[str]:
        out = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                out.add(os.readlink(f"/proc/self/fd/{fd}"))
        return out & dead_pipes

    ctx = multiprocessing.get_context("forkserver")
    within(60, lambda: ctx.Process(target=nap, args=(0,)).start())  # the fork server is up
    # A handler that keeps what it logs (as pytest's caplog does), the warning's exception too.
    kept = logging.handlers.BufferingHandler(1000)
    pp._logger.addHandler(kept)
    fs.connect_to_new_process = killing
    gc.disable()
    try:
        ex = pp.Executor(2, mp_context=ctx)
        ok, _ = within(60, ex.start_workers)
        left = open_dead_pipes()
        procs = ex.processes()
        got = {f.result(timeout=60) for f in [ex.submit(os.getpid) for _ in range(4)]}
        pp.kill_executors([ex], procs, [ex._executor_manager_thread], [ex._result_queue], 5)
        if not ok or len(procs) != 2 or launches != 3 or not got <= {p.pid for p in procs}:
            return f"FAIL: started {ok}, {len(procs)} processes after {launches} launches"
        if len(dead_pipes) != 2 or left:
            return f"FAIL: the dead launch's pipes {sorted(dead_pipes)}: {sorted(left)} still open"
        doomed = None
        launches = 0
        ex = pp.Executor(1, mp_context=ctx)
        try:
            ex.start_workers()
        except pp.LaunchError as exc:
            error = str(exc)
        else:
            return "FAIL: no LaunchError when every launch dies"
        finally:
            pp.kill_executors([ex], ex.processes(), [], [ex._result_queue], 5)
        if launches != pp.LAUNCH_ATTEMPTS or "times in a row" not in error:
            return f"FAIL: {launches} launches, {error!r}"
        if open_dead_pipes():
            return f"FAIL: pipes of dead launches still open: {sorted(open_dead_pipes())}"
        if len(kept.buffer) != pp.LAUNCH_ATTEMPTS:  # one for the first wave, two for the run
            return f"FAIL: {len(kept.buffer)} warnings logged"
    finally:
        fs.connect_to_new_process = original
        gc.enable()
        pp._logger.removeHandler(kept)
    return f"ok: started again after a death in the hand-over; {launches} deaths: LaunchError"


def _refuse() -> None:
    raise RuntimeError("this object cannot be loaded in a worker (as the check intends)")


class _Unloadable:
    """Pickles, but fails to unpickle: a worker's start that fails on its own."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


def launch_failure(pp: ModuleType) -> str:
    """A forkserver worker that exits by itself while reading its start-up data (here: an
    argument that fails to load, ahead of more data than a pipe holds) is not started again:
    LaunchError at once, naming its exit code."""
    import multiprocessing.forkserver as fs

    original = fs.connect_to_new_process
    launches = 0

    def counting(fds: Any) -> Any:
        nonlocal launches
        launches += 1
        return original(fds)

    ctx = multiprocessing.get_context("forkserver")
    fs.connect_to_new_process = counting
    try:
        ex = pp.Executor(1, mp_context=ctx, initializer=nap, initargs=(_Unloadable(), b"x" * 2**20))
        try:
            ok, error = within(60, ex.start_workers)
        finally:
            pp.kill_executors([ex], ex.processes(), [], [ex._result_queue], 5)
    finally:
        fs.connect_to_new_process = original
    if not ok or not isinstance(error, pp.LaunchError) or launches != 1:
        return f"FAIL: {launches} launch(es), start_workers gave {error!r}"
    if "exited with code 1" not in str(error):
        return f"FAIL: {error}"
    return "ok: not started again; LaunchError names exit code 1"


def _children_of(pid: int | None) -> set[int]:
    """Live children of ``pid`` (from /proc: this check needs no psutil)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry))
    return out


def main(argv: list[str]) -> int:
    # Whatever hangs in a way the scenarios do not catch: tracebacks, then exit.
    faulthandler.dump_traceback_later(240, exit=True)
    old_order = "--old-order" in argv
    names = [a for a in argv if not a.startswith("--")]
    pp = load_procpool()
    scenarios: dict[str, Callable[[], str]] = {
        "kill_after_crash": lambda: kill_after_crash(pp, old_order),
        "graceful_after_crash": lambda: graceful_after_crash(pp),
        "submit_after_crash": lambda: submit_after_crash(pp),
        "graceful_idle": lambda: graceful_idle(pp),
        "start_all_spawn": lambda: start_all(pp, "spawn"),
        "start_all_forkserver": lambda: start_all(pp, "forkserver"),
        "start_all_fork": lambda: start_all(pp, "fork"),
        "fork_warning": lambda: fork_warning(pp),
        "staggered": lambda: staggered(pp),
        "launch_retry": lambda: launch_retry(pp),
        "launch_failure": lambda: launch_failure(pp),
    }
    failed = False
    for name in names or list(scenarios):
        try:
            line = scenarios[name]()
        except BaseException as exc:
            line = f"FAIL: {exc!r}"
        failed |= not line.startswith("ok")
        print(f"{name}: {line}  [Python {sys.version.split()[0]}]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
