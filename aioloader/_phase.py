"""The phases of an epoch (see ``_epoch``). A module of its own so every stage can name them."""

from __future__ import annotations

import enum

__all__ = ("TERMINAL", "Phase")


class Phase(enum.Enum):
    CREATED = "created"  # made by __aiter__; nothing started
    STARTING = "starting"  # workers starting, off the loop
    RUNNING = "running"  # scheduler submitting, results arriving
    RECOVERING = "recovering"  # a worker died: the recovery task replaces them; no submissions
    FINISHED = "finished"  # terminal: the consumer received the end
    FAILED = "failed"  # terminal: a fatal error waits for the consumer; workers released
    ENDED = "ended"  # terminal: ended early (break, GC, cancellation, superseded, aclose)


TERMINAL = frozenset({Phase.FINISHED, Phase.FAILED, Phase.ENDED})
