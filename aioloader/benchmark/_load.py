"""How busy the machine was with work that is not the benchmark's (Linux ``/proc``).

The benchmark alternates the loaders so that load from other processes hits both alike, but a
ratio measured on a busy machine still says less than one measured on an idle one. Each workload
is therefore reported with the CPU that processes *outside* the benchmark's process tree used
while it ran: the whole machine's busy time from ``/proc/stat`` minus this process's and its
descendants' CPU time (live ones read from ``/proc/<pid>/stat``, finished ones through the
``cutime``/``cstime`` of whoever reaped them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ("BackgroundLoad", "LoadMeter", "OtherLoad")

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot, or None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal ...: idle and iowait are not busy.
    values = [int(v) for v in fields[1:9]]
    return (sum(values) - values[3] - values[4]) / _TICK


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()  # the name may contain spaces and parentheses
    # rest[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14-17.
    return int(rest[1]), sum(int(v) for v in rest[11:15]) / _TICK


def _tree_cpu_s(root: int, exclude: Collection[int] = ()) -> float:
    """CPU seconds of ``root`` and every live descendant (with what each has reaped), less the
    subtrees of ``exclude``."""
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _proc_stat(int(name))) is not None:
            stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


@dataclass(frozen=True)
class OtherLoad:
    """CPU used during one measured span, in cores on average (1.0 = one core busy throughout)."""

    others: float
    ours: float
    cores: int

    def describe(self) -> str:
        return (
            f"other processes used {self.others:.2f} of {self.cores} cores on average "
            f"(the benchmark {self.ours:.2f})"
        )


class LoadMeter:
    """Measures :class:`OtherLoad` between :meth:`start` and :meth:`stop`; None where ``/proc``
    is missing (not Linux). Processes in ``exclude`` (the background load) count as others."""

    def __init__(self, exclude: Collection[int] = ()) -> None:
        self._exclude = exclude
        self._t0 = 0.0
        self._busy0: float | None = None
        self._ours0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._busy0 = _machine_busy_s()
        self._ours0 = _tree_cpu_s(os.getpid(), self._exclude) if self._busy0 is not None else 0.0

    def stop(self) -> OtherLoad | None:
        busy1 = _machine_busy_s()
        if self._busy0 is None or busy1 is None:
            return None
        wall = max(time.monotonic() - self._t0, 1e-9)
        ours = _tree_cpu_s(os.getpid(), self._exclude) - self._ours0
        # Descendants that ended and were reaped by a process outside the tree (none here, as
        # a rule) would count as others; CPU accounting granularity is one tick.
        others = max(0.0, (busy1 - self._busy0) - ours)
        return OtherLoad(others / wall, ours / wall, os.cpu_count() or 1)


class BackgroundLoad:
    """``n`` busy-looping processes while the ``with`` block runs: a machine where other work
    wants the cores too, the same for every loader and limit measured meanwhile. They run at the
    benchmark's own niceness (0 when started from a shell), like the loaders' main processes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> BackgroundLoad:
        for _ in range(self.n):
            self._procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                )
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.wait()
        self._procs.clear()
