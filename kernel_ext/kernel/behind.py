"""Which ranks are behind the others: judged on time, from their bars' updates.

A fraction of the outermost bar was the measure: with a coarse outer bar
(4 epochs) a rank 0.15 s behind the others read a whole epoch (25%) behind at
every epoch boundary, and its "behind" mark came and went each epoch, its
row with it.  Here a rank's place is all its nested bars at once (the outer
bar's count plus the inner bars' fractions of one outer step), and the
measure is time: how long ago most of the other ranks were past the place
where this rank is now.  A rank is behind when that lag reaches
``BEHIND_LAG`` seconds and ``BEHIND_SHARE`` of the time the bars have run,
and stays so until the lag drops under half of that (hysteresis), so a lag
that hovers at the threshold does not flicker either.

A plain function of the bars' updates and their arrival times, no widget:
the view feeds it, tests feed it recorded traces.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from ..timing import BEHIND_LAG, BEHIND_SHARE, VIEW_REFRESH

HISTORY = 4096   # places kept per rank; beyond it every other one is dropped (the lag is then a little short)


@dataclass
class _Open:
    pos: int
    n: float
    total: Optional[float]


@dataclass
class _Rank:
    bars: dict = field(default_factory=dict)     # key -> _Open, the bars not closed
    outer_key: object = None                      # the outermost bar's key
    loops: int = 0                                # outermost bars begun so far
    times: list = field(default_factory=list)     # when each place in ``places`` was reached
    places: list = field(default_factory=list)    # (loops, steps): increasing
    running: bool = True
    flagged: bool = False


class Behind:
    """Feed :meth:`bar` with every bar update and :meth:`ended` when a rank
    stops running; :meth:`judge` says which ranks are behind at a time."""

    def __init__(self, lag: float = BEHIND_LAG, share: float = BEHIND_SHARE) -> None:
        self.min_lag, self.share = lag, share
        self.ranks: dict[int, _Rank] = {}
        self.first: Optional[float] = None

    def reset(self, rank: int) -> None:
        """A rank begins again (a restart's new attempt)."""
        self.ranks[rank] = _Rank()

    def ended(self, rank: int) -> None:
        self.ranks.setdefault(rank, _Rank()).running = False

    def bar(self, t: float, rank: int, key, pos: int, n: float, total: Optional[float], closed: bool) -> None:
        r = self.ranks.setdefault(rank, _Rank())
        if self.first is None:
            self.first = t
        if closed and key != r.outer_key:
            r.bars.pop(key, None)   # an inner bar done: its outer bar's count says it
        else:
            r.bars[key] = _Open(pos, n, total)   # the outermost stays, closed, until the next loop's
            if key != r.outer_key and pos <= min(b.pos for b in r.bars.values()):
                r.outer_key = key   # a new outermost bar: the next loop
                r.loops += 1
                for other in [k for k, b in r.bars.items() if k != key and b.pos <= pos]:
                    del r.bars[other]   # the loop before's
        place = (r.loops, self._steps(r))
        if not r.places or place > r.places[-1]:
            r.places.append(place)
            r.times.append(t)
            if len(r.places) > HISTORY:
                r.places, r.times = r.places[::2] + r.places[-1:], r.times[::2] + r.times[-1:]

    @staticmethod
    def _steps(r: _Rank) -> float:
        """The outer bar's count plus the inner bars' fraction of one of its steps."""
        chain = sorted(r.bars.values(), key=lambda b: b.pos)
        if not chain or r.outer_key not in r.bars:
            return r.places[-1][1] if r.places else 0.0
        inner = 0.0
        for b in reversed(chain[1:]):
            if b.total:
                inner = min(1.0, (b.n + inner) / b.total)
        return chain[0].n + inner

    def lag(self, rank: int, now: float) -> float:
        """How long ago most of the other ranks were past where ``rank`` is now."""
        r = self.ranks[rank]
        if not r.places:
            return 0.0
        here = r.places[-1]
        past = []
        for q, other in self.ranks.items():
            if q == rank or not other.places:
                continue
            i = bisect.bisect_right(other.places, here)
            if i < len(other.places):
                past.append(other.times[i])
        need = len(self.ranks) - len(self.ranks) // 2   # the upper median is past it: one fast rank is no reason
        if len(past) < need:
            return 0.0
        return max(0.0, now - sorted(past)[need - 1])

    def judge(self, now: float) -> set:
        """The ranks behind at ``now`` (each verdict kept until the lag is well under it)."""
        if self.first is None:
            return set()
        threshold = max(self.min_lag, self.share * (now - self.first))
        for rank, r in self.ranks.items():
            if not r.running:
                r.flagged = False
                continue
            lag = self.lag(rank, now)
            r.flagged = lag >= threshold / 2 if r.flagged else lag >= threshold
        return {rank for rank, r in self.ranks.items() if r.flagged}


def flips(trace: list, every: float = VIEW_REFRESH, **kw) -> tuple[dict, set]:
    """Replay a recorded trace of bar updates ``(t, rank, key, pos, n, total,
    closed)``, judging every ``every`` seconds as the view refreshes: how many
    times each rank's verdict changed, and who was behind at the end."""
    behind = Behind(**kw)
    changes: dict = {}
    last: set = set()
    trace = sorted(trace, key=lambda u: u[0])
    t = trace[0][0] if trace else 0.0
    i = 0
    while i < len(trace):
        t += every
        while i < len(trace) and trace[i][0] <= t:
            behind.bar(*trace[i][:7])
            i += 1
        now = behind.judge(t)
        for rank in now ^ last:
            changes[rank] = changes.get(rank, 0) + 1
        last = now
    return changes, last
