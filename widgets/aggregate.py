"""The compact form's aggregate row (many ranks, see :mod:`.progress_view`):
plain functions of the ranks' states (rank -> :class:`.rows.RankState`)."""
from __future__ import annotations

import html

from accel_magics.kernel_ext.kernel.events import bytes_text, rank_runs, ranks_label, without_times

from .rows import ATTENTION_ROWS, STATE_COLORS, STATE_ORDER, BarState, bar_html, el, plural


def attention(states: dict, behind: set) -> list[int]:
    """The ranks the compact form shows on their own: failed (the root
    cause among them), then paused at their prompt (where they stopped),
    then behind; at most ``ATTENTION_ROWS``."""
    failed = sorted(r for r, s in states.items() if s.state == "failed")
    paused = sorted(r for r, s in states.items() if s.state == "paused")
    return (failed + paused + sorted(behind - set(failed) - set(paused)))[:ATTENTION_ROWS]


def groups(states: dict, behind: set) -> dict[str, list[int]]:
    """The ranks by state, in ``STATE_ORDER`` (a straggler counts as behind)."""
    by_state: dict[str, list[int]] = {}
    for rank, s in sorted(states.items()):
        by_state.setdefault("behind" if rank in behind else s.state, []).append(rank)
    return {state: by_state[state] for state in sorted(by_state, key=lambda st: (
        STATE_ORDER.index(st) if st in STATE_ORDER else len(STATE_ORDER), st))}


def aggregate_html(states: dict, final: bool, behind: set) -> str:
    """One row for every rank: how many, grouped by state, the slowest and
    the fastest rank's outer bar, and memory (all ranks now; the largest
    peak in the record)."""
    text = " &middot; ".join(f"<b style='color:{STATE_COLORS.get(state, '#ff7f0e')}'>{state}</b> "
                               f"{rank_runs(ranks)}" for state, ranks in groups(states, behind).items())
    if not final:   # what quiet ranks are busy with: "importing accelerate 0-7"
        busy: dict[str, list[int]] = {}
        for rank, s in sorted(states.items()):
            if s.phase and not s.latest and s.state in ("running", "starting"):
                busy.setdefault(s.phase, []).append(rank)
        text += "".join(f" &middot; <i>{html.escape(phase)}</i> {rank_runs(ranks)}" for phase, ranks in busy.items())
    usage = peak_text(states) if final else usage_now_text(states)
    bars = extreme_bars_html(states, STATE_COLORS["done" if final else "running"], final)
    return el("div", "aggregate",
               el("span", "label", f"<b>{plural(len(states), 'rank')}</b>")
               + el("span", "groups", text)
               + (el("span", "usage", usage) if usage else "")
               + (el("div", "bars", bars) if bars else ""))


def extreme_bars_html(states: dict, color: str, final: bool = False) -> str:
    """The slowest and the fastest rank's outer bar (one bar when all are
    level; live, the second one's place is kept: ranks level one moment
    and apart the next must not make the view jump)."""
    outer = {}
    for rank, s in states.items():
        bars = [b for b in s.shown_bars() if b.fraction is not None]
        if bars:
            outer[rank] = bars[0]
    if not outer:
        return ""
    slow = min(outer, key=lambda r: (outer[r].fraction, r))
    fast = max(outer, key=lambda r: (outer[r].fraction, -r))
    if outer[slow].fraction < outer[fast].fraction:
        picks = [(slow, f"slowest: rank {slow}: "), (fast, f"fastest: rank {fast}: ")]
        return "".join(bar_html(BarState(0, outer[r].fraction, what + outer[r].text), color) for r, what in picks)
    # All level: no one rank's times and rate stand for the others'
    level = BarState(0, outer[slow].fraction, f"{ranks_label(outer)}: {without_times(outer[slow].text)}")
    return bar_html(level, color) + ("" if final or len(states) < 2 else bar_html(level, color, hidden=True))


def usage_now_text(states: dict) -> str:
    now = [s.usage for s in states.values() if s.usage is not None and s.state in ("running", "paused")]
    if not now:
        return ""
    gpu = [u[2] for u in now if u[2] is not None]
    return (f"cpu {sum(u[0] for u in now):.0f}% &middot; {bytes_text(sum(u[1] or 0 for u in now))} in all"
            + (f" &middot; GPU {bytes_text(sum(gpu))}" if gpu else ""))


def peak_text(states: dict) -> str:
    peaks = {r: s.peak_rss for r, s in states.items() if s.peak_rss}
    if not peaks:
        return ""
    top = max(peaks, key=peaks.get)
    return f"largest peak: rank {top} {bytes_text(peaks[top])}"
