"""A rank's traceback, formatted within a bound of time and size.

An infinite recursion under a raised recursion limit
(``sys.setrecursionlimit(10**6)``) ends in a traceback of a million entries;
``traceback.TracebackException`` makes a summary of each (its position, its
source line) before it collapses the repeats, which kept a rank formatting
for tens of seconds, past ``--timeout`` (a session's cell was then lost: its
ranks were in our code when the stop came).  Here every traceback of the exception and
of its chain keeps both ends, ``EDGE`` entries each (the cell's own call is
at the outer one, where it failed at the inner one), and says in one line how
many were left out between; a chain keeps its first ``CHAIN`` exceptions.
Walking a million entries to find the inner end costs a tenth of a second.

The exception's own objects are changed only while it is formatted (a
chained exception's ``__traceback__`` and the links past ``CHAIN``), then
put back as they were.
"""
from __future__ import annotations

import collections
import traceback
import types
from typing import Callable, Optional

EDGE = 100    # entries kept at each end of a traceback
CHAIN = 32    # exceptions of a chain (causes, contexts, a group's members) formatted


class _Elided(traceback.StackSummary):
    """A stack with ``left_out`` entries taken out at ``at``, said there in one line."""

    at = 0
    left_out = 0
    total = 0

    def format(self, **kwargs) -> list:
        head = traceback.StackSummary.from_list(list(self[:self.at])).format(**kwargs)
        tail = traceback.StackSummary.from_list(list(self[self.at:])).format(**kwargs)
        return head + [f"  [... {self.left_out} frames left out of {self.total}: the first and last {EDGE} "
                       "are shown ...]\n"] + tail


def shortened(tb: Optional[types.TracebackType]) -> tuple[Optional[types.TracebackType], int]:
    """``tb`` with at most ``2 * EDGE`` entries (new ones: ``tb`` is left as
    it is), both ends kept; and how many were left out between."""
    head: list = []
    tail: collections.deque = collections.deque(maxlen=EDGE)
    count = 0
    entry = tb
    while entry is not None:
        (head if count < EDGE else tail).append(entry)
        count += 1
        entry = entry.tb_next
    left_out = count - len(head) - len(tail)
    if not left_out:
        return tb, 0
    new = None
    for entry in reversed(head + list(tail)):
        new = types.TracebackType(new, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return new, left_out


def exception(exc: BaseException, tb, prune: Optional[Callable] = None) -> traceback.TracebackException:
    """``traceback.TracebackException(type(exc), exc, tb)``, bounded (see the
    module doc).  ``prune(te)``: a caller's change of the frames (leaving its
    own out), made before the left-out lines are placed."""
    put_back: list = []      # (object, attribute, value): the exception chain as it was
    left: dict = {}          # id(exception) -> entries left out of its traceback
    try:
        short, left_out = shortened(tb)
        if left_out:
            left[id(exc)] = left_out
        budget = CHAIN - 1
        seen, queue = {id(exc)}, collections.deque([exc])
        while queue:
            current = queue.popleft()
            linked = [(attr, getattr(current, attr, None)) for attr in ("__cause__", "__context__")]
            members = [(None, member) for member in (getattr(current, "exceptions", None) or ())
                       if isinstance(current, BaseException) and isinstance(member, BaseException)]
            for attr, other in linked + members:
                if other is None or id(other) in seen:
                    continue
                if budget <= 0:
                    if attr is not None:   # past the bound: not formatted (a group's member cannot be cut)
                        put_back.append((current, attr, other))
                        setattr(current, attr, None)
                    continue
                budget -= 1
                seen.add(id(other))
                queue.append(other)
                other_short, other_left = shortened(other.__traceback__)
                if other_left:
                    put_back.append((other, "__traceback__", other.__traceback__))
                    other.__traceback__ = other_short
                    left[id(other)] = other_left
        te = traceback.TracebackException(type(exc), exc, short)
        marks = []
        for error, summary in _pairs(exc, te):
            if id(error) in left and len(summary.stack) > EDGE:
                marks.append((summary, {id(frame) for frame in summary.stack[EDGE:]}, left[id(error)],
                              len(summary.stack) + left[id(error)]))
        if prune is not None:
            te = prune(te)
        for summary, tail, left_out, total in marks:
            frames = list(summary.stack)
            stack = _Elided(frames)
            stack.at = next((i for i, frame in enumerate(frames) if id(frame) in tail), len(frames))
            stack.left_out, stack.total = left_out, total
            summary.stack = stack
        return te
    finally:
        for obj, attr, value in reversed(put_back):
            setattr(obj, attr, value)


def _pairs(exc: BaseException, te: traceback.TracebackException) -> list:
    """Each exception of the chain with its summary (``te`` mirrors ``exc``)."""
    found, stack, seen = [], [(exc, te)], set()
    while stack:
        error, summary = stack.pop()
        if id(summary) in seen:
            continue
        seen.add(id(summary))
        found.append((error, summary))
        for attr in ("__cause__", "__context__"):
            if getattr(error, attr, None) is not None and getattr(summary, attr, None) is not None:
                stack.append((getattr(error, attr), getattr(summary, attr)))
        stack.extend(zip(getattr(error, "exceptions", None) or (), getattr(summary, "exceptions", None) or ()))
    return found


def format_exception(exc: BaseException, tb, prune: Optional[Callable] = None) -> str:
    """The text ``traceback.format_exception`` gives, bounded (see :func:`exception`)."""
    return "".join(exception(exc, tb, prune).format())
