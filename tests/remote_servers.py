"""Real servers for the remote-data tests: the HTTP object store and an S3-compatible server.

* the HTTP store is :mod:`aioloader.benchmark._store` (its own process; latency, bandwidth,
  errors and JPEG objects can be set);
* the S3 server is moto's server mode (``python -m moto.server``, from ``moto[server]``), in a
  process of its own on a free loopback port, with one bucket filled with raw objects of the
  same bytes as the HTTP store's (:func:`aioloader.benchmark._store.expected_bytes`).

Both are stopped by their fixtures (tests/conftest.py), which check that the process is gone and
its port closed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import psutil

from aioloader.benchmark._store import expected_bytes, object_key

#: Credentials and region moto accepts (any will do; these are moto's documented test values).
S3_CREDENTIALS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "region_name": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def assert_gone(pid: int, port: int) -> None:
    """The server's process is no more (not even a zombie) and nothing answers on its port."""
    if psutil.pid_exists(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            status = psutil.Process(pid).status()
            raise AssertionError(f"server process {pid} outlived its fixture ({status})")
    assert not port_open(port), f"port {port} still answers after the server stopped"


class MotoS3:
    """moto's S3 server on 127.0.0.1 with a bucket of ``count`` objects of ``size`` bytes.

    Object ``i`` is at key :func:`object_key` ``(i)`` and holds ``expected_bytes(i, size)``.
    """

    bucket = "aioloader-test"

    def __init__(self, *, count: int = 64, size: int = 10_000, start_timeout: float = 60) -> None:
        self.count = count
        self.size = size
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, **{k.upper(): v for k, v in S3_CREDENTIALS.items()}),
        )
        try:
            self._wait(start_timeout)
            self._fill()
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode} at start")
            try:
                with urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"moto server did not answer within {timeout:g} s")
            time.sleep(0.1)

    def client(self) -> Any:
        """A synchronous boto3 S3 client for this server (boto3 comes with moto)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **S3_CREDENTIALS)

    def _fill(self) -> None:
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=self.bucket)
            for i in range(self.count):
                s3.put_object(
                    Bucket=self.bucket, Key=object_key(i), Body=expected_bytes(i, self.size)
                )
        finally:
            s3.close()

    def expected(self, i: int) -> bytes:
        return expected_bytes(i, self.size)

    def obstore(self) -> Any:
        """An ``obstore`` S3Store for the bucket."""
        from obstore.store import S3Store

        return S3Store(
            self.bucket,
            endpoint=self.endpoint,
            access_key_id=S3_CREDENTIALS["aws_access_key_id"],
            secret_access_key=S3_CREDENTIALS["aws_secret_access_key"],
            region=S3_CREDENTIALS["region_name"],
            client_options={"allow_http": True},
            virtual_hosted_style_request=False,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(30)


@contextlib.contextmanager
def moto_s3(**kwargs: Any) -> Iterator[MotoS3]:
    server = MotoS3(**kwargs)
    try:
        yield server
    finally:
        server.stop()
    assert_gone(server.pid, server.port)
