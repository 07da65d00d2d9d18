"""A persistent loader kept alive by a notebook's output history: a warning, and a close.

IPython keeps every cell's result (``Out[n]``, ``_n``, ``_``, ``__``, ``___``) for the rest of the
session. A persistent loader shown as a cell's result is therefore never collected: re-running
the cell makes a new loader and leaves the old one's workers running, and the ``ResourceWarning``
a collected loader would give never comes. The loaders' ``_repr_pretty_`` (IPython's hook for
the text it shows) calls :func:`warn_if_kept`, which says so once per loader.

After each cell (IPython's ``post_run_cell`` event, in a kernel, whose event loop runs between
cells) a loader shown that way, once bound to a name of the user's and now held by nothing but
the output history (the name was given to a new loader, or deleted), is closed, as the
collector would have done without that history. Only the
history may hold it: any other reference (a variable, a list, an iterator, a running task, an
object of a C extension) leaves it alone.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import sys
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ("warn_if_kept",)

_logger = logging.getLogger(__name__)

# Loaders already warned about: once per loader, whatever shows it (the loader, its bridge).
_warned: weakref.WeakSet[Any] = weakref.WeakSet()
# Loaders shown as a cell's result -> "Out[n]"; those a name of the user's held after a cell.
_shown: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_named: weakref.WeakSet[Any] = weakref.WeakSet()
# The shells our post_run_cell callback is registered with, and the closes it started.
_watched: weakref.WeakSet[Any] = weakref.WeakSet()
_closing: set[asyncio.Task[None]] = set()


def _never(loader: Any) -> bool:
    return False


#: Whether a loader runs on the thread and loop of a ``loader.sync()`` bridge; set by _bridge
#: (which imports this module, so this one cannot import it).
bridged: Callable[[Any], bool] = _never

# The names IPython's output history binds in the user's namespace: _, __, ___, _<n>.
_HISTORY_NAME = re.compile(r"_{1,3}|_\d+")


def _storing_displayhook() -> tuple[Any, Any, int] | None:
    """(IPython's displayhook, the result it shows, the stacklevel of the cell that called it)
    while that hook is showing a cell's result, which it keeps when its cache is on
    (``cache_size > 0``); else None.

    Told by the hook's own ``__call__`` being on the stack (ipykernel's hook does not keep
    IPython's ``is_active`` flag). A cell ending with ``;`` does not format its result there,
    and ``display(obj)`` goes through the display publisher: neither keeps it.
    """
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if get_ipython is not None else None
    hook = getattr(shell, "displayhook", None)
    if hook is None or not getattr(hook, "cache_size", 0):
        return None
    try:
        call = type(hook).__call__.__code__
    except AttributeError:  # not IPython's DisplayHook
        return None
    frame: FrameType | None = sys._getframe(2)  # warn_if_kept's caller: level 2 of warn()
    level = 2
    while frame is not None:
        if frame.f_code is call and frame.f_locals.get("self") is hook:
            return hook, frame.f_locals.get("result"), level + 1
        frame = frame.f_back
        level += 1
    return None


def warn_if_kept(loader: Any, shown: Any, close: str, scoped: str) -> None:
    """Warn (``UserWarning``, once per ``loader``) when IPython is showing ``shown`` (the loader
    or its bridge) in a cell's result that its output history will keep, and ``loader`` is open
    with persistent workers.

    ``close`` is the call that releases the workers, with ``{}`` for the object's name;
    ``scoped`` the statement that closes it at the end of a block.
    """
    if loader in _warned or loader._is_closed():
        return
    if not (loader.persistent_workers and loader.num_workers > 0):
        return
    shown_by = _storing_displayhook()
    if shown_by is None:
        return
    hook, result, stacklevel = shown_by
    _warned.add(loader)
    out = f"Out[{hook.prompt_count}]"
    if result is shown and shown is loader:
        _watch(hook.shell)
        _shown[loader] = out
    kind = type(shown).__name__
    if result is shown:
        where, later = f"{out} keeps this {kind}", f" (`{close.format(out)}` once the name is gone)"
    else:  # inside a list, a tuple, another object's repr: the result holds it
        where, later = f"{out} holds this {kind}, which keeps it", ""
    warnings.warn(
        f"aioloader: {where} alive, and with it {loader.num_workers} persistent workers: IPython "
        "keeps every cell's result (Out, _, __, ___), so the loader is not collected and its "
        f"workers run until it is closed. Release them with `{close.format('loader')}`{later}, "
        f"or use `{scoped}`; a cell ending with `;` keeps no result.",
        UserWarning,
        stacklevel=stacklevel,
    )


class _Probe:
    """A weakly referable object held as a loader is, to measure our own references."""


def _refcount(ref: weakref.ref[Any]) -> int:
    obj = ref()
    return sys.getrefcount(obj)


def _history_refs(shell: Any, ref: weakref.ref[Any]) -> int | None:
    """How many references to ``ref()`` IPython's output history holds, or None if anything
    else refers to it (found by the collector's referrers)."""
    obj = ref()
    ns = shell.user_ns
    hook = shell.displayhook
    # user_ns_hidden: IPython records the history names it binds there too.
    holders: dict[int, str] = {id(ns): "ns", id(ns.get("_oh")): "out"}
    holders[id(getattr(shell, "user_ns_hidden", None))] = "ns"
    holders[id(getattr(hook, "__dict__", None))] = "hook"
    for result in (
        getattr(shell, "last_execution_result", None),
        getattr(hook, "exec_result", None),
    ):
        if result is not None:
            holders[id(result)] = "result"
            holders[id(getattr(result, "__dict__", None))] = "result"
    count = 0
    for holder in gc.get_referrers(obj):
        kind = holders.get(id(holder))
        if kind == "result":
            count += (
                1
                if getattr(holder, "result", None) is obj
                or (isinstance(holder, dict) and holder.get("result") is obj)
                else 0
            )
            continue
        if kind is None or not isinstance(holder, dict):
            return None
        # A loop, not a comprehension: one would close over `obj` in a cell, a referrer.
        keys = []
        for key, value in holder.items():
            if value is obj:
                keys.append(key)
        if kind == "ns" and not all(
            isinstance(k, str) and _HISTORY_NAME.fullmatch(k) for k in keys
        ):
            return None  # still bound to a name of the user's
        if kind == "hook" and not set(keys) <= {"_", "__", "___"}:
            return None
        count += len(keys)
    return count


def _held_by_history_only(shell: Any, ref: weakref.ref[Any]) -> bool:
    """Whether every reference to ``ref()`` is the output history's: the collector's referrers
    are history containers, and the reference count has no reference besides theirs (a C object
    that refers to it without telling the collector, say)."""
    counted = _history_refs(shell, ref)
    if counted is None:
        return False
    probe = _Probe()
    ours = _refcount(weakref.ref(probe)) - 1  # less `probe` itself
    return _refcount(ref) - counted == ours


def _watch(shell: Any) -> None:
    events = getattr(shell, "events", None)
    if events is None or shell in _watched:
        return
    _watched.add(shell)
    events.register("post_run_cell", _after_cell)


def _after_cell(*_: object) -> None:
    # IPython's callback: a failure here would print a traceback under the user's cell.
    try:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
        if shell is not None:
            _close_forgotten(shell)
    except Exception:
        _logger.debug("aioloader: checking the loaders in the output history failed", exc_info=True)


def _close_forgotten(shell: Any) -> None:
    """Close the loaders shown as a cell's result that a name held and only the history holds."""
    named = {id(v) for k, v in shell.user_ns.items() if not _HISTORY_NAME.fullmatch(k)}
    for ref in [weakref.ref(loader) for loader in _shown]:
        loader = ref()
        if loader is None:
            continue
        if loader._is_closed():
            _shown.pop(loader, None)
            continue
        if id(loader) in named:
            _named.add(loader)
            continue
        if loader not in _named:
            continue  # never had a name: `loader = _` may still come
        del loader  # no reference of ours while the references are counted
        if _held_by_history_only(shell, ref):
            _close(ref)


def _close(ref: weakref.ref[Any]) -> None:
    loader = ref()
    if loader is None:
        return
    try:
        loop = asyncio.get_running_loop()
        # Closed on the loop its epochs ran on, never from another thread's bridge loop.
        loader._check_loop(loop, "close")
    except RuntimeError:
        return  # no running loop (a terminal's cells run one loop each), or another loop's
    if bridged(loader):
        return  # iterated through loader.sync(): its own thread and loop close it
    out = _shown.pop(loader, "the output history")
    task = loop.create_task(loader.aclose(), name="aioloader-close-forgotten")
    _closing.add(task)
    task.add_done_callback(_closed)
    warnings.warn(
        f"aioloader: closed the AsyncDataLoader shown as {out}: no name holds it any more, only "
        f"IPython's output history did, and its {loader.num_workers} persistent workers were "
        "still running.",
        UserWarning,
        stacklevel=2,
    )


def _closed(task: asyncio.Task[None]) -> None:
    _closing.discard(task)
    if not task.cancelled() and task.exception() is not None:
        _logger.warning("aioloader: closing a loader only the output history held failed",
                        exc_info=task.exception())  # fmt: skip
