"""Crash recovery: a dead worker is replaced and its batches loaded again, or the epoch fails.

Runs in: the event loop; one recovery task per crash, never two at once. The epoch is RECOVERING
while it runs: the scheduler submits nothing, and a crash noticed meanwhile (a replacement worker
dying while the batches in flight are resubmitted) is absorbed by the running task, which goes
round again, instead of starting a second recovery beside it.

Policy, per epoch (``max_worker_restarts``):

* an iterable dataset's worker is never replaced (its position in its stream died with it);
* a worker that died before it finished starting is a set-up error (an unimportable ``__main__``
  under spawn, say): restarting would only repeat it;
* an index batch that killed its worker twice is a :class:`~aioloader.PoisonBatchError`;
* a native fault (SIGSEGV, SIGBUS, ...) in the workers that replaced ones that faulted the same
  way, before they completed any batch resubmitted to them, is fatal: those batches crash every
  process that loads them. Each round costs a worker start-up (under spawn, importing torch,
  many seconds on a busy machine), so a crash that repeats is not retried round after round;
* past ``max_worker_restarts`` restarts the epoch fails with
  :class:`~aioloader.WorkerCrashedError`.

A process that dies while its parent hands it its start-up data is not a crash: the pool starts
another at once (``_procpool.LAUNCH_ATTEMPTS``), and only a run of such deaths fails the epoch,
with :class:`~aioloader.WorkerCrashedError` (:func:`start_failure`).

A crash is attributed to a batch only if the dead worker reported this epoch's number with it, so a
persistent worker that dies on an abandoned epoch's batch is not blamed on this one's.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import PoisonBatchError, WorkerCrashedError, emfile_error
from ._executor import CrashReport
from ._phase import Phase
from ._procpool import LaunchError
from ._tasks import start_task
from ._threads import run_off_loop

if TYPE_CHECKING:
    from ._backend import Backend
    from ._records import Counters, Flight, Plan


class RecoverySide(Protocol):
    """What the recovery uses of its epoch."""

    plan: Plan
    counters: Counters
    epoch_no: int
    phase: Phase
    generation: int
    backend: Backend | None
    in_flight: dict[int, Flight]
    #: An async source's open window whose samples went ahead to a worker: (send_idx, samples).
    window_ahead: tuple[int, Any] | None

    @property
    def terminal(self) -> bool: ...

    def enter_recovery(self) -> None: ...

    def leave_recovery(self) -> None: ...

    def unwatch(self) -> None: ...

    def submit(self, send_idx: int) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    def adopt(self, old: Backend, new: Backend) -> None:
        """Make ``new``, the replacement of the crashed ``old``, the epoch's workers."""
        ...


__all__ = ("Recovery", "RecoverySide", "start_error", "start_failure")

_logger = logging.getLogger(__name__)

# A process killed by one of these crashed by itself (a bad pointer, a failed assertion in native
# code), as opposed to being killed (SIGKILL, SIGTERM) or exiting.
_FAULTS = frozenset(
    -s for s in (signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT)
)


class Recovery:
    """The epoch's crash handling: :meth:`on_crash` is the one entry point."""

    def __init__(self, epoch: RecoverySide) -> None:
        self._epoch = epoch
        self._kills: Counter[int] = Counter()
        self.restarts = 0
        self.task: asyncio.Task[None] | None = None
        self._again = False
        # True while the recovery resubmits the batches in flight to the replacement workers.
        self.resubmitting = False
        # The native fault (exit code) that caused the last restart, and the batches that restart
        # resubmitted: the same fault before any of them completes ends the epoch.
        self._fault: int | None = None
        self._resubmitted: frozenset[int] = frozenset()

    def on_crash(self, gen: int) -> None:
        """A worker of generation ``gen`` died (sentinel or ``BrokenProcessPool``)."""
        ep = self._epoch
        if gen != ep.generation or ep.terminal:
            return  # stale (already handled) or nothing left to recover
        ep.generation += 1  # every other future of the dead workers is stale from now on
        ep.unwatch()
        if ep.phase is Phase.RECOVERING:
            self._again = True  # the running recovery goes round once more
            return
        ep.enter_recovery()
        loop = asyncio.get_running_loop()
        self.task = start_task(loop, self._run(), name=f"aioloader-recovery:{ep.epoch_no}")

    async def _run(self) -> None:
        ep = self._epoch
        try:
            while True:
                self._again = False
                backend = ep.backend
                assert backend is not None
                error = start_error(backend)
                if error is not None:
                    # Not a crash: workers of the pool's second wave could not be started
                    # (their queued batches failed with BrokenProcessPool). A new pool would
                    # most likely fail the same way.
                    ep.fail(start_failure(error))
                    return
                report: CrashReport = await run_off_loop(backend.crash_report, name="diagnose")
                err = self._crash_error(report)
                if err is not None:
                    _logger.debug("fatal worker crash: %s", err)
                    ep.fail(err)
                    return
                self.restarts += 1
                ep.counters.restarts += 1
                self._warn(report)
                self._fault = report.exitcode if report.exitcode in _FAULTS else None
                new = await backend.replace()
                if ep.terminal:
                    await new.shutdown(graceful=False)
                    return
                ep.adopt(backend, new)
                self._resubmitted = frozenset(ep.in_flight)
                self.resubmitting = True
                try:
                    for send_idx in sorted(ep.in_flight):
                        ep.submit(send_idx)
                        if self._again:
                            break
                finally:
                    self.resubmitting = False
                if not self._again:
                    break
            ep.leave_recovery()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the replacement's start too (EMFILE, launches that died)
            ep.fail(start_failure(exc))

    def _warn(self, report: CrashReport) -> None:
        ep = self._epoch
        limit = ep.plan.max_worker_restarts
        try:
            warnings.warn(
                f"{self._describe(report)}; restarting the workers and resubmitting "
                f"{len(ep.in_flight)} batch(es) in flight (restart {self.restarts} of "
                f"at most {limit} this epoch)",
                RuntimeWarning,
                stacklevel=1,
            )
        except Warning as warning:
            # Warnings are errors in this process (-W error): the crash is one too, and it
            # must reach the consumer as the loader's error type, not as the warning.
            raise WorkerCrashedError(
                f"{self._describe(report)} (not restarted: RuntimeWarning is an error here)",
                worker_id=report.worker_id,
                exitcode=report.exitcode,
            ) from warning

    def _held(self, report: CrashReport) -> int | None:
        """The send_idx of this epoch that the dead worker held, if any."""
        ep = self._epoch
        if report.send_idx is None:
            return None
        if report.epoch is not None and report.epoch != ep.epoch_no:
            return None  # a persistent worker died on an earlier epoch's batch
        if report.send_idx in ep.in_flight or self._ahead(report.send_idx) is not None:
            return report.send_idx
        return None

    def _ahead(self, send_idx: int) -> Any:
        """The samples of the open window ``send_idx`` if they went ahead to a worker (whose
        transform of them may be what killed it), else None."""
        window = self._epoch.window_ahead
        return window[1] if window is not None and window[0] == send_idx else None

    def _indices(self, held: int) -> Any:
        flight = self._epoch.in_flight.get(held)
        return flight.indices if flight is not None else self._ahead(held)

    def _describe(self, report: CrashReport) -> str:
        msg = f"DataLoader {report.describe()}"
        held = self._held(report)
        if held is not None:
            what = "loading" if held in self._epoch.in_flight else "transforming ahead"
            msg += f" while {what} batch send_idx={held} (indices {self._indices(held)!r})"
        return msg

    def _crash_error(self, report: CrashReport) -> WorkerCrashedError | None:
        """The error to fail the epoch with, or None if the workers may be restarted."""
        ep = self._epoch
        plan = ep.plan
        msg = self._describe(report)
        held = self._held(report)
        indices: Any = self._indices(held) if held is not None else None
        if held is not None:
            self._kills[held] += 1
        common = {"worker_id": report.worker_id, "exitcode": report.exitcode}
        # Exiting by itself (not killed by a signal) before the initializer ran: a set-up error.
        if not report.started and report.exitcode is not None and report.exitcode >= 0:
            return WorkerCrashedError(
                f"{msg} before it finished starting, so it is not restarted (a restart would "
                "fail the same way). Its own error is printed above. Under the spawn and "
                "forkserver start methods each worker imports the main module again: a script "
                "must create and iterate the loader only under `if __name__ == '__main__':`.",
                **common,
            )
        if plan.is_iterable:
            return WorkerCrashedError(
                f"{msg}. An IterableDataset worker's position in its stream dies with it, so "
                "it is not restarted (its samples would be lost or repeated).",
                **common,
            )
        if held is not None and self._kills[held] >= 2:
            return PoisonBatchError(
                f"{msg}. This index batch killed its worker twice: one of these samples crashes "
                "the process that loads it (look for a native crash or out-of-memory kill).",
                indices=indices,
                **common,
            )
        if (
            held is not None
            and report.exitcode is not None
            and report.exitcode == self._fault
            and self._resubmitted
            and self._resubmitted <= ep.in_flight.keys()
        ):
            return WorkerCrashedError(
                f"{msg}. The workers started after the previous crash, which faulted the same "
                f"way, crashed before completing any of the {len(self._resubmitted)} batch(es) "
                "resubmitted to them, so they are not restarted again: these samples crash "
                "every process that loads them (look for a native crash).",
                indices=indices,
                **common,
            )
        if self.restarts >= plan.max_worker_restarts:
            return WorkerCrashedError(
                f"{msg}. The workers were already restarted {self.restarts} time(s) this epoch "
                f"(max_worker_restarts={plan.max_worker_restarts}).",
                indices=indices,
                **common,
            )
        return None


def start_error(backend: Backend) -> BaseException | None:
    """Why some of ``backend``'s workers could not start (a pool starting in waves), if so."""
    error: BaseException | None = getattr(backend, "start_error", None)
    return error


def start_failure(error: BaseException) -> BaseException:
    """The error an epoch fails with when workers could not start."""
    if isinstance(error, OSError) and error.errno == errno.EMFILE:
        return emfile_error(error)
    if isinstance(error, LaunchError):
        crashed = WorkerCrashedError(str(error))
        crashed.__cause__ = error
        return crashed
    return error
