"""How the dataset reaches the workers (spawn/forkserver only). Runs in: both.

The dataset, ``collate_fn`` and ``worker_init_fn`` are pickled *once* into an unnamed file that
every worker reads in parallel, instead of once per worker through each worker's start-up pipe.
Tensors of at least :data:`SHARED_PAYLOAD_TENSOR_BYTES` are taken out of that file and handed over
through shared memory, so N workers do not hold N copies of a preloaded tensor dataset. Classes
and functions that plain pickle cannot name (lambdas, local functions, anything of ``__main__``)
are carried by value with cloudpickle; nothing else falls back (an open file or a lock raises
torch's error).
"""

from __future__ import annotations

import copyreg
import io
import mmap
import os
import pickle
import sys
import tempfile
import types
from collections.abc import Mapping
from typing import Any

import torch

from ._codec import PICKLE_PROTOCOL

__all__ = ("SHARED_PAYLOAD_TENSOR_BYTES", "PayloadFile", "dump_payload", "load_payload")

#: Dataset tensors at least this large are shared with the workers instead of pickled by value.
SHARED_PAYLOAD_TENSOR_BYTES = 1024 * 1024

_payload_tensors: list[torch.Tensor] = []  # set by load_payload() while unpickling in a worker


def _shared_payload_tensor(i: int) -> torch.Tensor:
    return _payload_tensors[i]


def _make_payload_pickler(
    base: type[pickle.Pickler], side: list[torch.Tensor]
) -> type[pickle.Pickler]:
    # The C pickler's class attribute is a descriptor (for an instance's own table), not a table.
    given = getattr(base, "dispatch_table", None)
    base_table = given if isinstance(given, Mapping) else copyreg.dispatch_table

    def reduce_dataset_tensor(t: torch.Tensor) -> tuple[Any, ...]:
        if t.numel() * t.element_size() >= SHARED_PAYLOAD_TENSOR_BYTES and t.device.type == "cpu":
            side.append(t)
            return _shared_payload_tensor, (len(side) - 1,)
        reduced: tuple[Any, ...] = t.__reduce_ex__(PICKLE_PROTOCOL)  # type: ignore[no-untyped-call]
        return reduced

    table = dict(base_table)
    table[torch.Tensor] = reduce_dataset_tensor
    # cloudpickle "pickles" an open text file by reading it whole into a StringIO: each worker
    # would then write into (or read) its own copy. Refuse it as plain pickle and torch do.
    table.pop(io.TextIOWrapper, None)
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
            by_value = not _main_is_importable()
            while True:
                base = _by_value_pickler() if by_value else pickle.Pickler
                f.seek(0)
                f.truncate()
                side.clear()
                try:
                    # Writing to the file (not to bytes) lets the GIL go at each 64 KiB frame
                    # the pickler flushes, so the loop runs while a large dataset is pickled,
                    # except while the pickler grows or frees its memo table: single C steps,
                    # 0.2-1 s each at 6 M objects. A persistent_id hook that yields every few
                    # thousand objects cannot split those (and made pickling 2.5x slower).
                    _make_payload_pickler(base, side)(f, protocol=PICKLE_PROTOCOL).dump(obj)
                    f.flush()
                    if by_value or not _names_main(fd):
                        break
                    # A class or function of the script's __main__, named by reference: it may
                    # be defined under `if __name__ == "__main__":`, which a worker's re-import
                    # of the script skips. cloudpickle sends __main__'s by value.
                    by_value = True
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    if not by_value and _needs_by_value(exc):
                        # A class or function pickle cannot name (a lambda, a local function):
                        # cloudpickle sends it by value. Nothing else falls back (an open file,
                        # a lock): torch's error stays.
                        by_value = True
                        continue
                    exc.add_note(_payload_note(obj, _make_payload_pickler(base, []), exc))
                    raise
        return PayloadFile(fd), list(side)
    except BaseException:
        os.close(fd)
        raise


_PAYLOAD_NAMES = ("dataset", "collate_fn", "worker_init_fn")


def _by_value_pickler() -> type[pickle.Pickler]:
    import cloudpickle  # type: ignore[import-untyped, unused-ignore]

    base: type[pickle.Pickler] = cloudpickle.Pickler
    return base


def _names_main(fd: int) -> bool:
    """Whether the pickle in ``fd`` may name something of ``__main__`` (a false yes costs only
    pickling by value). Read in chunks: the GIL goes at each read, so the loop runs meanwhile."""
    needle = b"__main__"
    offset, tail = 0, b""
    while chunk := os.pread(fd, 1 << 24, offset):
        if needle in tail + chunk[: len(needle)] or needle in chunk:
            return True
        offset += len(chunk)
        tail = chunk[-len(needle) :]
    return False


def _needs_by_value(exc: BaseException) -> bool:
    """Whether plain pickle failed to name a class or function (which cloudpickle sends by value).

    Such failures are ``PicklingError`` ("attribute lookup <lambda> on __main__ failed", "not the
    same object as ...") or, before Python 3.14, ``AttributeError`` ("Can't pickle local object").
    An object of a type that cannot be pickled at all raises ``TypeError``.
    """
    if isinstance(exc, pickle.PicklingError):
        return True
    return isinstance(exc, AttributeError) and str(exc).startswith("Can't pickle local object")


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickles(pickler: type[pickle.Pickler], obj: object) -> bool:
    try:
        pickler(_Discard(), protocol=PICKLE_PROTOCOL).dump(obj)
    except Exception:
        return False
    return True


def _parts(obj: object) -> list[tuple[str, object]]:
    """What pickling ``obj`` pickles, each with a suffix naming it (``.lock``, ``[2]``)."""
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return []
    try:
        reduced = obj.__reduce_ex__(PICKLE_PROTOCOL)
    except Exception:
        return []
    if not isinstance(reduced, tuple):
        return []
    parts: list[tuple[str, object]] = []
    state = reduced[2] if len(reduced) > 2 else None
    # getstate of an object with __slots__: (dict, slots); either may be None.
    for part in state if isinstance(state, tuple) and len(state) == 2 else (state,):
        if isinstance(part, dict):
            parts += [(f".{k}" if isinstance(k, str) else f"[{k!r}]", v) for k, v in part.items()]
        elif part is not None:
            parts.append(("", part))
    if len(reduced) > 3 and reduced[3] is not None:
        parts += [(f"[{i}]", v) for i, v in enumerate(reduced[3])]
    if len(reduced) > 4 and reduced[4] is not None:
        parts += [(f"[{k!r}]", v) for k, v in reduced[4]]
    return parts


def unpicklable_path(obj: object, name: str, pickler: type[pickle.Pickler]) -> tuple[str, object]:
    """The innermost part of ``obj`` that ``pickler`` cannot pickle, named from ``name``.

    Run only after pickling ``obj`` failed: pickles parts of it again to find the culprit.
    """
    for _ in range(64):
        for suffix, part in _parts(obj):
            if part is not obj and not _pickles(pickler, part):
                name, obj = name + suffix, part
                break
        else:
            break
    return name, obj


def _payload_note(obj: object, pickler: type[pickle.Pickler], exc: BaseException) -> str:
    where = "the dataset, collate_fn or worker_init_fn"
    path: tuple[str, object] | None = None
    if isinstance(obj, tuple) and len(obj) == len(_PAYLOAD_NAMES):
        for name, part in zip(_PAYLOAD_NAMES, obj, strict=True):
            if not _pickles(pickler, part):
                path = unpicklable_path(part, name, pickler)
                break
    if path is not None:
        where = f"{path[0]} (a {type(path[1]).__module__}.{type(path[1]).__qualname__})"
    if isinstance(exc, TypeError) and path is not None and "." in path[0]:
        return (
            f"aioloader: {where} cannot be pickled, so it cannot be sent to worker processes "
            "started with spawn/forkserver (torch's DataLoader refuses it too). Create it "
            "lazily, on first use in the worker (keep None until then, and drop it in "
            "__getstate__), or in worker_init_fn; or use multiprocessing_context='fork'."
        )
    return (
        f"aioloader: {where} cannot be sent to worker processes started with spawn/forkserver. "
        "Define them at module level, make them picklable, or use multiprocessing_context='fork'."
    )


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
