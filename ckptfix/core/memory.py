"""Keeping memory and time linear when millions of small objects are built."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_freeze_after = False  # see freeze_what_pauses_build


def freeze_what_pauses_build() -> None:
    """For a process that ends with its command (the console script, cli/entry.py): what a
    paused stretch built is frozen (gc.freeze) at its end instead of being handed to the
    collector. Those objects (a TensorInfo per tensor, and the like) live until the command
    ends and form no cycles, yet every later collection of the oldest generation would walk
    them all again: for 1,000,000 tensors, seconds each time (a third of a rewrite's plan,
    measured), during which no signal handler runs. Frozen, they are still freed by
    reference counting as usual. A library caller's process is left as it is."""
    global _freeze_after
    _freeze_after = True


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of small objects.

    Each generation-0 collection walks every young container, so parsing a 1,000,000-tensor
    header with it on takes five times as long; none of these objects form cycles.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if _freeze_after:
                gc.freeze()  # moves every tracked object out of the collector's reach: O(1)
            gc.enable()
