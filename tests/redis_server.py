"""A throwaway redis-server for tests and examples: a free loopback port, a temporary directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``redis-server`` on 127.0.0.1; ``url`` is where to reach it.

    ``persist=True`` keeps the data in an append-only file, so that :meth:`restart` (same port,
    same directory) comes back with the streams and groups it had, as a production server does.
    """

    def __init__(self, *, persist: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        self._binary = binary
        self._persist = persist
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="aioloader-redis-")
        self._start()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self._binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                self._dir.name,
                "--save",
                "",
                "--appendonly",
                "yes" if self._persist else "no",
                "--appendfsync",
                "always",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} at start")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("redis-server did not answer within 30 s")
            time.sleep(0.02)

    def _answers(self) -> bool:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", self.port), timeout=1) as s,
        ):
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False

    def _terminate(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> None:
        """Stops the server and starts it again on the same port and directory."""
        self._terminate()
        self._start()

    def stop_only(self) -> None:
        """Stops the server, keeping its port and directory for :meth:`start`."""
        self._terminate()

    def start(self) -> None:
        self._start()

    def freeze(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._terminate()
        self._dir.cleanup()


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        yield server
    finally:
        server.stop()
