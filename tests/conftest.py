"""Shared fixtures: every test must leave no child process, thread, fd or shm file behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import glob
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

# Datasets used across test modules live in tests/datasets.py so spawn/forkserver workers can
# import them by reference.
from tests import datasets

START_METHODS = ["fork", "spawn", "forkserver"]

#: Event loops the tests marked ``loops`` run under (pytest-asyncio's loop-factory hook: no
#: event-loop policy, which Python 3.14 deprecates). uvloop is an optional extra.
LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop
}
try:
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - the dev extra installs it
    pass
else:
    LOOP_FACTORIES["uvloop"] = _uvloop.new_event_loop


def pytest_configure(config: pytest.Config) -> None:
    """Give the test process a terminal's ^C, whatever started it.

    A shell starts a background job (``cmd &``, ``nohup``, a CI runner's detached step) with
    SIGINT ignored, and Python keeps an ignored SIGINT ignored, in this process and in every
    child it starts: the tests that press ^C (on this process, on a script, on a process group)
    would then interrupt nothing and wait out their timeouts. A handled signal is reset to the
    default in a child at exec, so restoring Python's own handler here restores it there too.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Main behaviour tests (marked ``loops``) run once per event loop; the rest on asyncio's."""
    if item.get_closest_marker("loops") is not None:
        return LOOP_FACTORIES
    return {"asyncio": asyncio.new_event_loop}


#: Servers a session-scoped fixture keeps running until the whole run ends (the shared
#: redis-server of ``redis_url``): children of this process, never a loader's workers.
_session_servers: set[int] = set()


@contextlib.contextmanager
def session_server(pid: int) -> Iterator[None]:
    """While the block runs, ``pid`` (and its children) is not counted by worker_processes()."""
    _session_servers.add(pid)
    try:
        yield
    finally:
        _session_servers.discard(pid)


def worker_processes() -> set[int]:
    """Our descendant processes, less the stdlib's process-wide helpers (kept by design) and the
    servers of session-scoped fixtures (see :func:`session_server`).

    The fork server and the resource tracker are started once and live as long as this process;
    forkserver *workers* are children of the fork server and are counted. A session fixture's
    server is started by the first test that asks for it and stops at the end of the run: every
    later test, whatever its module, would otherwise find it among its "workers".
    """
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            parent = p.ppid()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if p.pid in _session_servers or parent in _session_servers:
            continue
        if "resource_tracker" in cmd:
            continue
        if "multiprocessing.forkserver" in cmd and parent == os.getpid():
            continue
        out.add(p.pid)
    return out


def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _fd_targets(fds: set[str]) -> list[str]:
    out = []
    for fd in sorted(fds, key=int):
        try:
            out.append(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue
    return out


def _shm() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith(f"aioloader-{os.getpid()}-")}
    except FileNotFoundError:
        return set()


def _snapshot() -> tuple[set[int], set[int], int, set[str]]:
    return worker_processes(), _threads(), len(_fds()), _shm()


@pytest.fixture(scope="session", autouse=True)
def _start_global_helpers() -> None:
    """Start the stdlib's forkserver and resource tracker once, before any baseline is taken."""
    ctx = multiprocessing.get_context("forkserver")
    from aioloader._executor import _prepare_forkserver

    _prepare_forkserver(ctx)
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    # multiprocessing's fd-sharing listener (a thread and a socket) starts the first time this
    # process sends a shared-memory tensor to a worker (an index batch that is a tensor) and
    # lives as long as the process, as with torch's DataLoader.
    from multiprocessing import resource_sharer

    sharer: Any = resource_sharer._resource_sharer  # type: ignore[attr-defined]
    with sharer._lock:
        if sharer._address is None:
            sharer._start()
    if torch.cuda.is_available():
        # The CUDA driver opens its device files and a context once per process and keeps them;
        # open them before any test takes its fd baseline.
        pinned = torch.ones(1).pin_memory()
        pinned.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
    # multiprocessing's shared heap keeps its first small arena (and its fd) for the process's
    # life; the loader's shared counters come from it.
    _arena_keeper.append(multiprocessing.RawArray("q", 8))
    # It also keeps every arena below 4 MiB it grows into (a pool's arrays, a worker's start-up
    # errors among them, for many workers): grown once here, not by the first test that needs it.
    multiprocessing.RawArray("b", 1 << 20)  # freed at once; its arena stays
    # uvloop opens a process-wide pipe the first time a loop is made.
    try:
        import uvloop
    except ImportError:
        return

    async def nothing() -> None:
        return None

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(nothing())


_arena_keeper: list[object] = []


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a child process, thread, fd or shared-memory file behind."""
    before_children, before_threads, before_fds, before_shm = _snapshot()
    fds_before = _fds()
    yield
    if request.node.get_closest_marker("allow_leaks"):
        return
    deadline = time.monotonic() + 10
    while True:
        gc.collect()  # objects the test made (a tensor moved to shared memory) hold fds too
        children, threads, nfds, shm = _snapshot()
        new_children = children - before_children
        new_threads = threads - before_threads
        new_shm = shm - before_shm
        if not new_children and not new_threads and nfds <= before_fds and not new_shm:
            return
        if time.monotonic() > deadline:
            names = [t.name for t in threading.enumerate() if t.ident in new_threads]
            pytest.fail(
                f"leaked: children={sorted(new_children)} threads={names} "
                f"fds {before_fds}->{nfds} {_fd_targets(_fds() - fds_before)} "
                f"shm={sorted(new_shm)}"
            )
        time.sleep(0.05)


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def small_ds() -> datasets.RangeDataset:
    return datasets.RangeDataset(40)


def torch_batches(*args: object, **kwargs: object) -> list[object]:
    """What torch's DataLoader yields for the same arguments (the reference behaviour)."""
    return list(torch.utils.data.DataLoader(*args, **kwargs))  # type: ignore[arg-type]


async def collect(loader: object, limit: float = 60) -> list[object]:
    """Drain one epoch of ``loader`` within ``limit`` seconds."""
    async with asyncio.timeout(limit):
        return [b async for b in loader]  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------
# Executors: the core behaviour tests run against every backend through the `executor` fixture.
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_cli() -> str:
    import shutil
    import sys

    here = os.path.join(os.path.dirname(sys.executable), "ray")
    found = here if os.path.exists(here) else shutil.which("ray")
    if found is None:
        pytest.skip("the `ray` command is not installed next to this Python")
    return found


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local 2-CPU Ray cluster shared by every Ray test, connected as an existing cluster.

    Started with `ray start` rather than `ray.init()`: its processes then belong to no process of
    the test run (they are reparented), so the leak checks of the other tests do not see Ray's
    worker pool come and go. Stopped at the end of the session by killing the processes that use
    its own temporary directory (`ray stop` would stop every cluster on the machine).
    """
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'aioloader[ray]'")
    import shutil
    import subprocess
    import tempfile

    tmp = tempfile.mkdtemp(prefix="aioray-", dir="/tmp")  # short: Ray's socket paths are limited
    port = _free_port()
    # A throw-away cluster on the loopback interface: no token to hand between the processes.
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    # The actors import the tests' datasets by name, as spawned workers do.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    cmd = [
        _ray_cli(),
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={tmp}",
    ]
    saved_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        yield
    finally:
        if saved_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved_auth
        if ray.is_initialized():
            ray.shutdown()
        _kill_matching(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_matching(text: str) -> None:
    """SIGTERM, then SIGKILL, every process whose command line mentions ``text``."""
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in part for part in (p.info["cmdline"] or [])):
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def live_loader_actors() -> list[str]:
    """Ids of the loader's Ray actors that Ray's actor table does not list as DEAD."""
    from ray._private import state as ray_state

    return [
        aid
        for aid, info in ray_state.actors().items()
        if info.get("State") != "DEAD" and "_Actor" in str(info.get("ActorClassName", ""))
    ]


def ray_actor_ids() -> set[str]:
    """Every actor id in Ray's actor table, dead ones included."""
    from ray._private import state as ray_state

    return set(ray_state.actors())


def loader_actor_pids(since: set[str]) -> list[int]:
    """The process ids of the loader actors in Ray's actor table (dead ones included) that are
    not in ``since`` (a :func:`ray_actor_ids` taken before)."""
    from ray._private import state as ray_state

    return [
        int(info["Pid"])
        for aid, info in ray_state.actors().items()
        if aid not in since and "_Actor" in str(info.get("ActorClassName", "")) and info.get("Pid")
    ]


def _loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioloader")]


EXECUTORS = [
    pytest.param("process", id="process"),
    pytest.param("thread", id="thread"),
    # Ray keeps threads and connections of its own in this process, created as it needs them:
    # the generic leak check is replaced by the one below (no actor, no loader thread left).
    pytest.param("ray", id="ray", marks=pytest.mark.allow_leaks),
]


@pytest.fixture(params=EXECUTORS)
def executor(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``executor=`` for AsyncDataLoader: each core behaviour test runs on every backend."""
    if request.param != "ray":
        yield request.param
        return
    request.getfixturevalue("ray_cluster")
    from aioloader.ray import RayWorkers

    # No CPU reservation: a replacement set may start while Ray still accounts for the old one.
    yield RayWorkers(num_cpus=0)
    deadline = time.monotonic() + 30
    while (live_loader_actors() or _loader_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live_loader_actors(), "a Ray actor of the loader outlived the test"
    assert not _loader_threads(), f"loader threads left: {_loader_threads()}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Ray's parameter is slow unless the test is marked ``ray_default``; Ray tests run last.

    Every Ray actor is a fresh interpreter importing torch (seconds each on 2 cores): the default
    run keeps the few Ray cases that cover order, errors and recovery; ``-m slow`` runs them all.
    """

    def on_ray(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("executor") == "ray":
            return True
        return "ray_cluster" in getattr(item, "fixturenames", ())

    for item in items:
        callspec = getattr(item, "callspec", None)
        is_ray_case = callspec is not None and callspec.params.get("executor") == "ray"
        if is_ray_case and item.get_closest_marker("ray_default") is None:
            item.add_marker(pytest.mark.slow)
    # Ray tests last: once Ray is connected it keeps threads and sockets of its own in this
    # process, which no other test's leak check should have to tell from the loader's.
    items.sort(key=on_ray)  # stable: the order is otherwise unchanged


# --------------------------------------------------------------------------------------------
# Remote data: a real HTTP object store and a real S3 server (tests/remote_servers.py), each in
# a process of its own, stopped after and checked gone (no process, nothing on its port).
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def http_store() -> Iterator[Any]:
    """The shared HTTP object store: 256 raw objects of 10 KB, no latency, no errors. Tests
    must not change its settings or kill it: :func:`make_http_store` starts a store of their own."""
    from aioloader.benchmark._store import start_store
    from tests.remote_servers import assert_gone

    with start_store(size=10_000, count=256) as store:
        pid, port = store.pid, store.port
        with session_server(pid):
            yield store
    assert_gone(pid, port)


@pytest.fixture
def make_http_store() -> Iterator[Callable[..., Any]]:
    """``make_http_store(**StoreConfig settings)``: a store for this test alone, stopped after it
    (killed and restarted ones included)."""
    from aioloader.benchmark._store import HttpStore, StoreConfig
    from tests.remote_servers import assert_gone, port_open

    stores: list[Any] = []

    def make(**settings: Any) -> Any:
        store = HttpStore(StoreConfig(**settings))
        stores.append(store)
        return store

    yield make
    for store in stores:
        pid = store.proc.pid if store.proc is not None else None
        store.stop()
        if pid is not None:
            assert_gone(pid, store.port)
        else:  # killed and not restarted
            assert not port_open(store.port), f"port {store.port} answers after a kill"


@pytest.fixture(scope="session")
def s3_store() -> Iterator[Any]:
    """moto's S3 server (``moto[server]``) with bucket ``aioloader-test``: 64 objects of 10 KB
    at keys ``00000000``..``00000063``, bytes as the HTTP store's raw objects."""
    pytest.importorskip("moto.server", reason="pip install 'moto[server]' (the dev extra)")
    from tests.remote_servers import MotoS3, assert_gone

    server = MotoS3(count=64, size=10_000)
    try:
        # obstore's Rust runtime (its threads and epoll fds) starts at its first request and
        # lives as long as the process: start it here, before any test takes its baseline.
        with contextlib.suppress(ImportError):
            import obstore

            obstore.get(server.obstore(), "00000000").bytes()
        with session_server(server.pid):
            yield server
    finally:
        server.stop()
    assert_gone(server.pid, server.port)


def interpreters() -> dict[str, str]:
    """version -> executable: this Python, and every other CPython >= 3.11 installed by pyenv."""
    found = {sys.version.split()[0]: sys.executable}
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    for exe in sorted(glob.glob(f"{root}/versions/3.*/bin/python3")):
        m = re.search(r"/versions/(3\.(\d+)\.\d+)/", exe)
        if m and int(m.group(2)) >= 11 and m.group(1) not in found:
            found[m.group(1)] = exe
    return {v: found[v] for v in sorted(found, key=lambda v: tuple(map(int, v.split("."))))}
