"""How objects cross between the main process and the workers. Runs in: both.

Two directions, two policies:

* **Results (worker -> main).** A batch is pickled *in the worker* into ``bytes`` and the executor
  only moves those bytes. Tensors below :data:`INLINE_TENSOR_BYTES` travel inline (a memcpy);
  larger ones travel through shared memory with torch's own reductions, which hand over a file
  descriptor and never copy the data through the pipe. A shared-memory segment costs a descriptor
  hand-over per tensor (a socket round trip with the worker), which dominates for small tensors.
* **Worker payload (main -> workers, spawn/forkserver only).** The dataset, ``collate_fn`` and
  ``worker_init_fn`` are pickled *once* into an unnamed file that every worker reads in parallel,
  instead of once per worker through each worker's start-up pipe. Tensors of at least
  :data:`SHARED_PAYLOAD_TENSOR_BYTES` are taken out of that file and handed over through shared
  memory, so N workers do not hold N copies of a preloaded tensor dataset. Objects that plain
  pickle cannot carry (lambdas, classes defined in a notebook or ``python -c``) are carried with
  cloudpickle.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import mmap
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

__all__ = (
    "INLINE_TENSOR_BYTES",
    "SHARED_PAYLOAD_TENSOR_BYTES",
    "PayloadFile",
    "dump_payload",
    "dumps_result",
    "load_payload",
    "loads_result",
)

#: Tensors smaller than this are copied into the result bytes instead of shared memory. Measured
#: on 2 cores, 2 workers, one tensor per batch (batches/s, inline vs shared memory):
#: 16 KiB 3500 vs 1500, 64 KiB 3100 vs 1560, 256 KiB 2200 vs 1340, 384 KiB 1280 vs 1060,
#: 512 KiB 870 vs 1140, 1 MiB 650 vs 1540. The descriptor hand-over of a segment costs more than
#: copying up to ~400 KiB; 256 KiB keeps a margin below that crossover.
INLINE_TENSOR_BYTES = 256 * 1024

#: Dataset tensors at least this large are shared with the workers instead of pickled by value.
SHARED_PAYLOAD_TENSOR_BYTES = 1024 * 1024

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --------------------------------------------------------------------------------------------------
# Results: worker -> main


def _rebuild_inline_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if data:
        ctypes.memmove(out.data_ptr(), data, len(data))
    return out


def _is_plain_cpu_tensor(t: torch.Tensor) -> bool:
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout is torch.strided
        and not t.requires_grad
        and not t.is_quantized
    )


def _reduce_result_tensor(t: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    nbytes = t.numel() * t.element_size()
    if nbytes < INLINE_TENSOR_BYTES and _is_plain_cpu_tensor(t):
        # A conjugated or negated view is lazy: its memory holds the values before the flip, and
        # contiguous() keeps the flag. Materialise it, or the raw bytes would be wrong.
        c = t.resolve_conj().resolve_neg().contiguous()
        data = ctypes.string_at(c.data_ptr(), nbytes) if nbytes else b""
        return _rebuild_inline_tensor, (data, t.dtype, tuple(t.shape))
    # Large or special tensors: torch's own reduction, which moves the storage into shared memory
    # (default_collate already built it there when get_worker_info() is set) and sends an fd.
    return reduce_tensor(t)  # type: ignore[no-untyped-call,no-any-return]


class _ResultPickler(pickle.Pickler):
    # ForkingPickler's table holds torch's storage/event reductions; tensors get our policy above.
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    dispatch_table[torch.Tensor] = _reduce_result_tensor


def dumps_result(obj: object) -> bytes:
    """Pickle a batch for the trip to the main process (small tensors inline, large ones shared)."""
    buf = io.BytesIO()
    _ResultPickler(buf, protocol=_PICKLE_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads_result(data: bytes) -> Any:
    """Rebuild a batch pickled by :func:`dumps_result`."""
    return pickle.loads(data)


# --------------------------------------------------------------------------------------------------
# Worker payload: main -> workers

_payload_tensors: list[torch.Tensor] = []  # set by load_payload() while unpickling in a worker


def _shared_payload_tensor(i: int) -> torch.Tensor:
    return _payload_tensors[i]


def _make_payload_pickler(
    base: type[pickle.Pickler], side: list[torch.Tensor]
) -> type[pickle.Pickler]:
    base_table = getattr(base, "dispatch_table", copyreg.dispatch_table)

    def reduce_dataset_tensor(t: torch.Tensor) -> tuple[Any, ...]:
        if t.numel() * t.element_size() >= SHARED_PAYLOAD_TENSOR_BYTES and t.device.type == "cpu":
            side.append(t)
            return _shared_payload_tensor, (len(side) - 1,)
        reduced: tuple[Any, ...] = t.__reduce_ex__(_PICKLE_PROTOCOL)  # type: ignore[no-untyped-call]
        return reduced

    table = dict(base_table)
    table[torch.Tensor] = reduce_dataset_tensor
    return type("_PayloadPickler", (base,), {"dispatch_table": table})


def _main_is_importable() -> bool:
    # spawn and forkserver re-import the parent's __main__ from its file; a notebook, a REPL or
    # `python -c` has no such file, so anything defined there must be pickled by value.
    main = sys.modules.get("__main__")
    return bool(getattr(main, "__file__", None)) or getattr(main, "__spec__", None) is not None


class PayloadFile:
    """An unnamed file holding a pickled payload; crosses to workers as a file descriptor.

    It has no name in any file system, so nothing is left behind even if the process that made
    it is killed. It can be pickled only while a worker process is being started (spawn or
    forkserver), when multiprocessing hands the descriptor to the child.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import context
        from multiprocessing.reduction import DupFd

        if context.get_spawning_popen() is None:
            raise pickle.PicklingError("a PayloadFile travels only with a starting worker")
        return _adopt_payload_fd, (DupFd(self.fd),)


def _adopt_payload_fd(dup: Any) -> PayloadFile:
    return PayloadFile(dup.detach())


def _anonymous_file() -> int:
    try:
        return os.memfd_create("aioloader-payload", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux: an unlinked temporary file
        fd, path = tempfile.mkstemp(prefix=f"aioloader-{os.getpid()}-")
        os.unlink(path)
        return fd


def dump_payload(obj: object) -> tuple[PayloadFile, list[torch.Tensor]]:
    """Pickle ``obj`` once into an unnamed file for workers to read; return it and shared tensors.

    The caller owns the file and closes it when no worker will start again. Raises the pickling
    error, with a note saying what to change, when neither pickle nor cloudpickle can carry it.
    """
    fd = _anonymous_file()
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            side: list[torch.Tensor] = []
            errors: list[BaseException] = []
            picklers: list[type[pickle.Pickler]] = []
            if _main_is_importable():
                picklers.append(pickle.Pickler)
            import cloudpickle  # type: ignore[import-untyped, unused-ignore]

            picklers.append(cloudpickle.Pickler)
            for base in picklers:
                f.seek(0)
                f.truncate()
                side.clear()
                try:
                    # Writing to the file (not to bytes) lets the GIL go at each 64 KiB frame
                    # the pickler flushes, so the loop runs while a large dataset is pickled,
                    # except while the pickler grows or frees its memo table: single C steps,
                    # 0.2-1 s each at 6 M objects. A persistent_id hook that yields every few
                    # thousand objects cannot split those (and made pickling 2.5x slower).
                    _make_payload_pickler(base, side)(f, protocol=_PICKLE_PROTOCOL).dump(obj)
                    break
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    errors.append(exc)
            else:
                err = errors[-1]
                err.add_note(
                    "aioloader: the dataset, collate_fn or worker_init_fn cannot be sent to worker "
                    "processes started with spawn/forkserver. Define them at module level, make "
                    "them picklable, or use multiprocessing_context='fork'."
                )
                raise err
        return PayloadFile(fd), list(side)
    except BaseException:
        os.close(fd)
        raise


def load_payload(payload: PayloadFile, tensors: list[torch.Tensor]) -> Any:
    """Unpickle a payload written by :func:`dump_payload`. Runs in: a worker process."""
    global _payload_tensors
    _payload_tensors = tensors
    try:
        # mmap, not read(): the workers' descriptors share one file offset.
        with mmap.mmap(payload.fd, 0, prot=mmap.PROT_READ) as view:
            return pickle.loads(view)
    finally:
        _payload_tensors = []
        payload.close()
