"""A real HTTP object store for tests, the ``remote`` benchmark and the examples.

Run as its own process::

    python -m aioloader.benchmark._store --port 0 --latency-ms 20 --size 100000 --count 10000

(or ``python path/to/_store.py ...``, as :class:`HttpStore` starts it: this file imports only the
standard library, aiohttp and, for JPEG objects, Pillow; not torch, not the package.)

prints the port it listens on (one line on stdout) once it serves, then serves until SIGTERM or
SIGINT (or, with ``--watch-stdin``, until its standard input closes: the parent that started it
is gone). From Python, :func:`start_store` starts that process and stops it after::

    with start_store(latency_ms=20, size=100_000, count=1000, jpeg=True) as store:
        url = store.object_url(7)          # http://127.0.0.1:PORT/objects/00000007

Routes: ``GET /objects/{key}`` (``key`` is :func:`object_key` of an index below ``count``; any
other key is a 404 ``NoSuchKey``), ``GET /info`` (the settings and the objects' mean size, JSON),
``GET /stats`` (requests answered, by status, and the most in flight at once), ``POST /control``
(a JSON object of settings to change while it runs, e.g. ``{"error_rate": 0.1}``).

What can be set (:class:`StoreConfig`): first-byte latency, a fraction of slow requests and their
factor (``slow_fraction=0.01, slow_factor=20``: a tail), per-connection bandwidth, the object
size and count, an error rate and which errors (503 ``SlowDown``, 429, 500, as S3 answers them),
the first ``fail_first`` requests for every key answering ``errors[0]`` (a deterministic
transient failure for retry tests), a rate of connections reset with no answer, and JPEG objects
(real images of about ``size`` bytes, made with Pillow, deterministic: the image of index ``i``
is one of a pool of ``jpeg_pool`` and its class, :func:`jpeg_label`, is its dominant colour). A
store "that goes away" is :meth:`HttpStore.kill` (SIGKILL); :meth:`HttpStore.restart` brings it
back on the same port.

Raw objects are :func:`expected_bytes`: ``size`` bytes, the index in the first 8, the same
seeded random block after (cheap to serve and to check). The server answers from memory with no
per-request work beyond that header, so on loopback it is not what bounds a client at 100 KB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = (
    "HttpStore",
    "StoreConfig",
    "expected_bytes",
    "jpeg_label",
    "make_jpegs",
    "object_key",
    "start_store",
)

#: Classes of the JPEG objects: the image of index ``i`` is of class ``i % JPEG_CLASSES``.
JPEG_CLASSES = 4
#: Dominant colour of each class (RGB, 0-255).
_PALETTE = ((220, 40, 40), (40, 200, 60), (50, 70, 230), (230, 210, 40))
_MAGIC = b"aiostore"


@dataclasses.dataclass
class StoreConfig:
    """What the store does; every field can also be changed at run time (``/control``)."""

    latency_ms: float = 0.0  # before the first byte of every answer (errors included)
    slow_fraction: float = 0.0  # this fraction of requests waits slow_factor x latency_ms
    slow_factor: float = 20.0
    bandwidth: float | None = None  # bytes/s per connection (None: as fast as the socket goes)
    size: int = 100_000  # bytes per object (JPEG objects: about that)
    count: int = 1000  # objects: indices 0..count-1
    error_rate: float = 0.0  # this fraction of requests answers one of `errors`
    errors: tuple[int, ...] = (503, 429, 500)
    fail_first: int = 0  # the first N requests for every key answer errors[0]
    reset_rate: float = 0.0  # this fraction of connections is aborted with no answer
    jpeg: bool = False
    jpeg_pool: int = 16  # distinct images (a multiple of JPEG_CLASSES)
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["errors"] = list(self.errors)
        return d

    def update(self, changes: dict[str, Any]) -> None:
        for name, value in changes.items():
            if name not in _FIELDS:
                raise KeyError(f"unknown store setting {name!r}")
            setattr(self, name, tuple(value) if name == "errors" else value)


_FIELDS = {f.name for f in dataclasses.fields(StoreConfig)}
#: Settings that change the objects themselves: fixed when the store starts.
_FIXED = {"size", "jpeg", "jpeg_pool", "seed"}


def object_key(i: int) -> str:
    """The key of object ``i``."""
    return f"{i:08d}"


def _index_of(key: str, count: int) -> int | None:
    if len(key) != 8 or not key.isdigit():
        return None
    i = int(key)
    return i if i < count else None


def _block(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(max(size, len(_MAGIC) + 8))


def expected_bytes(i: int, size: int = 100_000, seed: int = 0) -> bytes:
    """The bytes of raw object ``i`` of a store of ``size``-byte objects and ``seed``."""
    return _raw(i, _block(size, seed), size)


def _raw(i: int, block: bytes, size: int) -> bytes:
    head = struct.pack(">Q", i) + _MAGIC
    return (head + block[len(head) :])[:size]


def jpeg_label(i: int) -> int:
    """The class of JPEG object ``i`` (its dominant colour): ``i % JPEG_CLASSES``."""
    return i % JPEG_CLASSES


def _render(side: int, j: int, seed: int, quality: int = 90) -> bytes:
    from PIL import Image

    rng = random.Random(seed * 1_000_003 + j)
    colour = _PALETTE[j % JPEG_CLASSES]
    grad = Image.linear_gradient("L").resize((side, side)).rotate(rng.choice((0, 90, 180, 270)))
    bands = []
    for c in colour:
        tinted = grad.point(lambda v, c=c: c * (128 + v // 2) // 255)
        noise = Image.frombytes("L", (side, side), rng.randbytes(side * side))
        bands.append(Image.blend(tinted, noise, 0.18))
    buf = io.BytesIO()
    Image.merge("RGB", bands).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def make_jpegs(size: int, pool: int = 16, seed: int = 0) -> list[bytes]:
    """``pool`` deterministic JPEGs of about ``size`` bytes each (image ``j`` of class
    ``j % JPEG_CLASSES``): the side is fitted on the first image, within ~5 %."""
    side = max(8, int((size * 8 / 5) ** 0.5))  # a first guess at ~5 bits per pixel
    for _ in range(6):
        got = len(_render(side, 0, seed))
        if abs(got - size) <= 0.05 * size:
            break
        side = max(8, int(side * (size / got) ** 0.5))
    return [_render(side, j, seed) for j in range(pool)]


# --------------------------------------------------------------------------------------------
# The server (runs in its own process)
# --------------------------------------------------------------------------------------------

_ERROR_BODIES = {
    503: ("SlowDown", "Please reduce your request rate."),
    429: ("TooManyRequests", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    404: ("NoSuchKey", "The specified key does not exist."),
}


def _error_xml(status: int, key: str) -> str:
    code, msg = _ERROR_BODIES.get(status, ("Error", "error"))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{msg}</Message><Key>{key}</Key></Error>"
    )


class _Server:
    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.block = b"" if cfg.jpeg else _block(cfg.size, cfg.seed)
        self.jpegs = make_jpegs(cfg.size, cfg.jpeg_pool, cfg.seed) if cfg.jpeg else []
        self.attempts: dict[int, int] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.by_status: dict[str, int] = {}
        self.bytes_sent = 0

    def info(self) -> dict[str, Any]:
        sizes = [len(j) for j in self.jpegs] or [self.cfg.size]
        return {
            **self.cfg.to_json(),
            "mean_object_bytes": sum(sizes) / len(sizes),
            "pid": os.getpid(),
        }

    def body(self, i: int) -> bytes:
        if self.cfg.jpeg:
            return self.jpegs[i % len(self.jpegs)]
        return _raw(i, self.block, self.cfg.size)

    def _count(self, status: int | str) -> None:
        self.by_status[str(status)] = self.by_status.get(str(status), 0) + 1

    async def get_object(self, request: Any) -> Any:
        from aiohttp import web

        cfg = self.cfg
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            key = request.match_info["key"]
            delay = cfg.latency_ms / 1e3
            if cfg.slow_fraction and self.rng.random() < cfg.slow_fraction:
                delay *= cfg.slow_factor
            if delay > 0:
                await asyncio.sleep(delay)
            i = _index_of(key, cfg.count)
            if i is None:
                self._count(404)
                return web.Response(
                    status=404, text=_error_xml(404, key), content_type="application/xml"
                )
            if cfg.reset_rate and self.rng.random() < cfg.reset_rate:
                self._count("reset")
                if request.transport is not None:
                    request.transport.abort()  # RST, no answer; what follows goes nowhere
                return web.Response(status=500)
            status = 0
            if cfg.fail_first:
                seen = self.attempts.get(i, 0)
                self.attempts[i] = seen + 1
                if seen < cfg.fail_first:
                    status = cfg.errors[0]
            if not status and cfg.error_rate and self.rng.random() < cfg.error_rate:
                status = self.rng.choice(cfg.errors)
            if status:
                self._count(status)
                headers = {"Retry-After": "0"} if status in (429, 503) else {}
                return web.Response(
                    status=status,
                    text=_error_xml(status, key),
                    content_type="application/xml",
                    headers=headers,
                )
            body = self.body(i)
            ctype = "image/jpeg" if cfg.jpeg else "application/octet-stream"
            self._count(200)
            self.bytes_sent += len(body)
            if not cfg.bandwidth:
                return web.Response(body=body, content_type=ctype)
            return await self._paced(request, body, ctype, float(cfg.bandwidth))
        finally:
            self.in_flight -= 1

    async def _paced(self, request: Any, body: bytes, ctype: str, rate: float) -> Any:
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": ctype})
        resp.content_length = len(body)
        await resp.prepare(request)
        chunk = max(1024, int(rate / 100))  # about 10 ms per chunk
        start = time.perf_counter()
        view = memoryview(body)
        for off in range(0, len(body), chunk):
            await resp.write(view[off : off + chunk])
            due = start + (off + chunk) / rate
            pause = due - time.perf_counter()
            if pause > 0:
                await asyncio.sleep(pause)
        await resp.write_eof()
        return resp

    async def get_info(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(self.info())

    async def get_stats(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response(
            {
                "by_status": self.by_status,
                "max_in_flight": self.max_in_flight,
                "in_flight": self.in_flight,
                "bytes_sent": self.bytes_sent,
                "cpu_s": time.process_time(),
            }
        )

    async def post_control(self, request: Any) -> Any:
        from aiohttp import web

        changes = await request.json()
        if not isinstance(changes, dict) or _FIXED & set(changes):
            raise web.HTTPBadRequest(text=f"settings fixed at start: {sorted(_FIXED)}")
        try:
            self.cfg.update(changes)
        except KeyError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
        if changes.get("reset_stats"):
            self.by_status.clear()
            self.max_in_flight = self.in_flight
        return web.json_response(self.cfg.to_json())


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def _serve(cfg: StoreConfig, sock: socket.socket, watch_stdin: bool) -> None:
    from aiohttp import web

    server = _Server(cfg)
    app = web.Application()
    app.router.add_get("/objects/{key}", server.get_object)
    app.router.add_get("/info", server.get_info)
    app.router.add_get("/stats", server.get_stats)
    app.router.add_post("/control", server.post_control)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock, shutdown_timeout=0.5)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if watch_stdin:
        # The parent holds our stdin's other end: EOF means it is gone, so nothing outlives it.
        def wait_eof() -> None:
            # os.read, not sys.stdin: a buffered reader's lock held by this daemon thread at
            # exit is a fatal error of the interpreter.
            with contextlib.suppress(OSError):
                while os.read(0, 4096):
                    pass
            loop.call_soon_threadsafe(stop.set)

        threading.Thread(target=wait_eof, name="store-stdin", daemon=True).start()
    print(sock.getsockname()[1], flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, StoreConfig]:
    p = argparse.ArgumentParser(prog="python -m aioloader.benchmark._store", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    p.add_argument("--config", help="every setting as one JSON object (overrides the flags)")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--slow-fraction", type=float, default=0.0)
    p.add_argument("--slow-factor", type=float, default=20.0)
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s per connection")
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--errors", default="503,429,500", help="statuses, comma list")
    p.add_argument("--fail-first", type=int, default=0)
    p.add_argument("--reset-rate", type=float, default=0.0)
    p.add_argument("--jpeg", action="store_true")
    p.add_argument("--jpeg-pool", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    p.add_argument("--no-uvloop", action="store_true")
    a = p.parse_args(argv)
    cfg = StoreConfig(
        latency_ms=a.latency_ms,
        slow_fraction=a.slow_fraction,
        slow_factor=a.slow_factor,
        bandwidth=a.bandwidth,
        size=a.size,
        count=a.count,
        error_rate=a.error_rate,
        errors=tuple(int(s) for s in a.errors.split(",") if s),
        fail_first=a.fail_first,
        reset_rate=a.reset_rate,
        jpeg=a.jpeg,
        jpeg_pool=a.jpeg_pool,
        seed=a.seed,
    )
    if a.config:
        cfg.update(json.loads(a.config))
    return a, cfg


def main(argv: Sequence[str] | None = None) -> int:
    args, cfg = _parse(argv)
    sock = _bind(args.host, args.port)
    factory = None
    if not args.no_uvloop:
        try:
            import uvloop

            factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(cfg, sock, args.watch_stdin))
    return 0


# --------------------------------------------------------------------------------------------
# The handle: start, control and stop the server process
# --------------------------------------------------------------------------------------------


class HttpStore:
    """A running store process; :func:`start_store` is the usual way to get one."""

    def __init__(self, cfg: StoreConfig, *, host: str = "127.0.0.1", port: int = 0,
                 start_timeout: float = 60.0) -> None:  # fmt: skip
        self.config = cfg
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._start()

    # -- addresses --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The store's base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the store is not running")
        return self.proc.pid

    def object_url(self, i: int | str) -> str:
        key = object_key(i) if isinstance(i, int) else i
        return f"{self.url}/objects/{key}"

    def expected(self, i: int) -> bytes:
        """Raw object ``i`` as the store serves it (not for JPEG stores)."""
        if self.config.jpeg:
            raise ValueError("a JPEG store's objects are images; see jpeg_label()")
        return expected_bytes(i, self.config.size, self.config.seed)

    # -- control ----------------------------------------------------------------------------

    def _call(self, path: str, data: dict[str, Any] | None = None) -> dict[str, Any]:
        body = None if data is None else json.dumps(data).encode()
        req = urllib.request.Request(self.url + path, data=body, method="GET" if data is None
                                     else "POST")  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            out: dict[str, Any] = json.loads(resp.read())
        return out

    def info(self) -> dict[str, Any]:
        return self._call("/info")

    def stats(self) -> dict[str, Any]:
        return self._call("/stats")

    def configure(self, **changes: Any) -> None:
        """Change settings while it runs (``reset_stats=True`` also zeroes the counters)."""
        self._call("/control", changes)
        self.config.update({k: v for k, v in changes.items() if k != "reset_stats"})

    # -- life -------------------------------------------------------------------------------

    def _start(self) -> None:
        # This file run by its path, not with -m: importing the package would import torch
        # (seconds, and hundreds of MB in a process that only serves bytes).
        cmd = [
            sys.executable,
            "-P",  # not this file's folder on sys.path: the benchmark's modules are there
            os.path.abspath(__file__),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--config",
            json.dumps(self.config.to_json()),
            "--watch-stdin",
        ]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc = proc
        assert proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout
        line = b""
        try:
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the store did not start in {self.start_timeout:g} s")
                ready, _, _ = select.select([proc.stdout], [], [], left)
                if ready:
                    got = os.read(proc.stdout.fileno(), 64)
                    if not got:
                        raise RuntimeError(f"the store exited at start ({proc.wait(10)})")
                    line += got
            self.port = int(line)
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """The store goes away: SIGKILL, no goodbye to open connections."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        self._reap(proc)

    def restart(self) -> None:
        """Kill it if it runs, then start it again on the same port (its counters start at 0)."""
        self.kill()
        self._start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; the process is reaped and its pipes closed."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._reap(proc)

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait(30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.proc = None

    def __enter__(self) -> HttpStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def start_store(*, host: str = "127.0.0.1", port: int = 0, **settings: Any) -> Iterator[HttpStore]:
    """Start a store process with :class:`StoreConfig` ``settings``; stop it after the block
    (no process, pipe or socket of it left)."""
    store = HttpStore(StoreConfig(**settings), host=host, port=port)
    try:
        yield store
    finally:
        store.stop()


if __name__ == "__main__":
    raise SystemExit(main())
