"""The ranks' printed lines in a run's view (see :mod:`.progress_view`): the
"all ranks" pane's lines and the record's output blocks, plain functions of
the ranks' states (rank -> :class:`.rows.RankState`)."""
from __future__ import annotations

import html

from accel_magics.kernel_ext.kernel.events import ranks_label, without_times

from .rows import MONO, OPEN_RECORD_LINES, STYLE, RankState, plural, pre


def merged_lines(states: dict, max_lines: int) -> list[str]:
    """The "all ranks" pane: the newest lines, each rank with a fair share
    of them, interleaved.  A rank printing a 1,000-line batch must not
    push the others out of the pane (2 ranks x 20,000 lines showed only
    rank 0's): every rank that printed keeps at least ``max_lines //
    ranks`` of its newest lines (a share a quiet rank leaves unused goes to
    the others); and lines that arrived between the same two refreshes
    are interleaved rank by rank in proportion (each rank's in its own
    order), so the newest lines on screen are every printing rank's, not
    the last batch's rank.  Across refreshes, arrival order holds."""
    printing = [s for s in states.values() if s.lines]
    if not printing:
        return []
    budget, quota = max_lines, {}
    for i, s in enumerate(sorted(printing, key=lambda s: len(s.lines))):   # the smallest first
        quota[s.rank] = min(len(s.lines), budget // (len(printing) - i))
        budget -= quota[s.rank]
    picked = []
    for s in printing:
        n = quota[s.rank]
        windows, lines = list(s.seqs)[-n:], list(s.lines)[-n:]
        in_window: dict[int, int] = {}
        for window in windows:
            in_window[window] = in_window.get(window, 0) + 1
        seen: dict[int, int] = {}
        for window, line in zip(windows, lines):
            seen[window] = seen.get(window, 0) + 1
            picked.append(((window, seen[window] / in_window[window], s.rank), f"[rank {s.rank}] {line}"))
    return [line for _, line in sorted(picked)]


def same_key(s: RankState) -> tuple:
    """What must match for ranks to share a block: their lines, a finished
    bar's line compared without its times (ranks' rates always differ)."""
    def key(lines):
        return tuple(without_times(line) if line in s.bar_lines else line for line in lines)
    return s.count, key(s.head), key(s.lines)


def output_html(states: dict, ranks: list[int], s: RankState, log_dir: str) -> str:
    """One block of the record: the output of ``ranks``, which printed the
    same lines (``s`` is one of them; ``states``: every rank's)."""
    head, tail = list(s.head), list(s.lines)
    left_out = s.count - len(head) - len(tail)
    if s.count <= len(tail):
        head, left_out = [], 0
    elif left_out < 0:   # they overlap: the tail from where the head ends
        head, tail, left_out = head, tail[-left_out:], 0
    shown = (f", the first {len(head)} and the last {len(tail)} shown" if left_out else "")
    same = ""
    if len(ranks) > 1:
        exact = len({(tuple(states[r].head), tuple(states[r].lines)) for r in ranks}) == 1
        same = ", the same on each" + ("" if exact else f" but for their bars' times; these are rank {ranks[0]}'s")
    opened = " open" if s.count <= OPEN_RECORD_LINES else ""
    where = f"; the full log is in {html.escape(log_dir)}" if log_dir else ""
    gap = (f"<div style='{STYLE['muted']};{MONO}'>... {plural(left_out, 'line')} left out{where} ...</div>"
           if left_out else "")
    body = (pre(head) + gap + pre(tail)) if left_out else pre(head + tail)
    return (f"<details{opened}><summary>{ranks_label(ranks)} output ({plural(s.count, 'line')}{shown}{same})"
            f"</summary>{body}</details>")
