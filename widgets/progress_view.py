"""The live progress view of one run, as ipywidgets, fed plain engine events.

Layout: a header (world size, nodes, master, elapsed time, overall state),
one row per rank (state, progress bar, latest line) and the ranks' output in
tabs: "all ranks" interleaved, then one tab per rank.  Memory is bounded: the
panes keep the last ``max_lines`` lines; the full logs live in files (the
header shows where).

Events only update Python-side state; widget traits are written by
:meth:`refresh`, at most once per ``interval`` (and when the run ends), so a
rank printing 100k lines costs a few comm messages per second, like
ipykernel's stream batching.  :meth:`summary_html` renders the final state as
static HTML, which the notebook keeps after the run (no widget state needed).

This module imports ipywidgets only; events are duck-typed by class name.
"""
from __future__ import annotations

import html
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import ipywidgets as w

_FRACTION = re.compile(r"(?<!\d)(?P<n>\d+)\s*/\s*(?P<total>\d+)")   # starts only at a number's start: linear

STATE_COLORS = {"starting": "#888", "running": "#1f77b4", "done": "#2ca02c", "failed": "#d62728",
                "stopped": "#ff7f0e"}


PROGRESS_TAIL = 256   # progress is read from a line's last characters only: linear, bounded


def parse_progress(text: str) -> Optional[tuple[float, str]]:
    """(fraction, description) from a tqdm-like line, or None.

    Linear and bounded: only the line's last ``PROGRESS_TAIL`` characters are
    read, with string searches (no backtracking regex), so a rank printing
    megabyte-long lines costs the kernel nothing here.
    """
    tail = text[-PROGRESS_TAIL:]
    bar = tail.rfind("%|")
    if bar > 0:
        start = bar
        while start > 0 and bar - start < 3 and tail[start - 1].isdigit():
            start -= 1
        if start < bar and tail.find("|", bar + 2) > 0:
            head = tail[:start].rstrip()
            desc = head[:-1].strip() if head.endswith(":") else ""
            return min(1.0, int(tail[start:bar]) / 100), desc
    m = _FRACTION.search(tail) if "/" in tail else None
    if m and int(m.group("total")) > 0:
        return min(1.0, int(m.group("n")) / int(m.group("total"))), ""
    return None


@dataclass
class _RankState:
    rank: int
    state: str = "starting"
    fraction: Optional[float] = None
    desc: str = ""
    latest: str = ""
    lines: deque = field(default_factory=deque)
    count: int = 0
    pane_dirty: bool = False


class RunView:
    """One run's live view. Call it with events; display :attr:`widget`."""

    def __init__(self, max_lines: int = 100, interval: float = 0.2, pane_interval: float = 1.0,
                 log_dir: str = "") -> None:
        self.max_lines = max_lines
        self.interval = interval
        self.pane_interval = pane_interval
        self.log_dir = log_dir
        self.ranks: dict[int, _RankState] = {}
        self.all_lines: deque = deque(maxlen=max_lines)
        self.status = "starting"
        self.world = ""
        self.attempt = ""
        self.started = time.monotonic()
        self.elapsed = 0.0
        self.error = ""
        self.world_note = ""
        self._last_refresh = 0.0
        self._dirty = True

        self.header = w.HTML()
        self.rows = w.VBox()
        self.tabs = w.Tab()
        self.widget = w.VBox([self.header, self.rows, self.tabs])
        self.widget.add_class("accel-magics-run")
        self._row_widgets: dict[int, tuple] = {}
        self._pane_widgets: dict[object, w.HTML] = {}
        self._all_dirty = False
        self._last_pane_refresh = 0.0
        self.refresh(force=True)

    # -- events --------------------------------------------------------------
    def __call__(self, event) -> None:
        handler = getattr(self, "on_" + type(event).__name__, None)
        if handler is not None:
            handler(event)
            self._dirty = True
        if time.monotonic() - self._last_refresh >= self.interval:
            self.refresh()

    def _rank(self, rank: int) -> _RankState:
        if rank not in self.ranks:
            self.ranks[rank] = _RankState(rank, lines=deque(maxlen=self.max_lines))
        return self.ranks[rank]

    def on_RunStarted(self, e) -> None:
        self.status = "running"
        nodes = f"node {e.node_rank} of {e.num_nodes}" if e.num_nodes > 1 else "1 node"
        self.world = (f"{len(e.ranks)} rank{'s' if len(e.ranks) != 1 else ''} on {nodes} "
                      f"(world size {e.world_size}; ranks {e.ranks[0]}-{e.ranks[-1]}), "
                      f"master {e.master_addr}:{e.master_port}")
        self.attempt = f"attempt {e.attempt + 1} of {e.max_restarts + 1}" if e.max_restarts else ""
        if e.num_nodes > 1:
            self.status = "waiting"
            self.world_note = f"rendezvous at {e.master_addr}:{e.master_port}"
        for rank in e.ranks:
            state = self._rank(rank)
            state.state, state.fraction, state.latest = "running", None, ""

    def on_Output(self, e) -> None:
        if self.status == "waiting":
            self.status = "running"
        state = self._rank(e.rank)
        lines = e.last_lines(self.max_lines)    # only what the panes can show
        state.lines.extend(lines)
        state.count += e.count
        state.latest = lines[-1]
        state.pane_dirty = self._all_dirty = True
        self.all_lines.extend(f"[rank {e.rank}] {line}" for line in lines)
        for line in reversed(lines[-50:]):   # the batch's latest progress line, if any
            parsed = parse_progress(line)
            if parsed is not None:
                state.fraction, state.desc = parsed[0], parsed[1] or state.desc
                break

    def on_ProgressLine(self, e) -> None:
        state = self._rank(e.rank)
        state.latest = e.text.strip()
        parsed = parse_progress(e.text)
        if parsed is not None:
            state.fraction, state.desc = parsed[0], parsed[1] or state.desc

    def on_Progress(self, e) -> None:
        state = self._rank(e.rank)
        if e.total:
            state.fraction = min(1.0, e.n / e.total)
        state.desc = e.desc or state.desc
        state.latest = f"{e.desc + ': ' if e.desc else ''}{e.n:g}{'/%g' % e.total if e.total else ''}"

    def on_RankExited(self, e) -> None:
        state = self._rank(e.rank)
        if e.failure is not None:
            state.state = "failed"
            state.latest = e.failure.summary
        elif e.stopped:
            state.state = "stopped"
        else:
            state.state = "done"

    def on_RunFinished(self, e) -> None:
        self.status = {"ok": "done"}.get(e.status, e.status)
        self.elapsed = time.monotonic() - self.started
        if e.root_cause is not None:
            self.error = f"rank {e.root_cause.rank} failed: {e.root_cause.summary}"
        self.refresh(force=True)

    def on_Waiting(self, e) -> None:
        self.status = "waiting"
        self.world_note = f"waiting for {e.expected - e.joined} of {e.expected} nodes at {e.address}"

    def on_Heartbeat(self, e) -> None:
        self._dirty = True   # elapsed time moves on

    # -- rendering -------------------------------------------------------------
    def _header_html(self, final: bool = False) -> str:
        elapsed = self.elapsed if final else time.monotonic() - self.started
        color = STATE_COLORS.get({"ok": "done"}.get(self.status, self.status), "#d62728")
        world = html.escape(self.world or "starting")
        if self.status == "waiting":
            world += " &middot; " + html.escape(self.world_note)
        parts = [f"<b style='color:{color}'>{html.escape(self.status)}</b>", world,
                 f"{elapsed:.1f} s"]
        if self.attempt:
            parts.append(html.escape(self.attempt))
        text = " &middot; ".join(parts)
        if self.error:
            text += f"<br><span style='color:#d62728'>{html.escape(self.error)}</span>"
        if self.log_dir:
            text += f"<br><small>full logs: <code>{html.escape(self.log_dir)}</code></small>"
        return f"<div class='accel-magics-header'>{text}</div>"

    def refresh(self, force: bool = False) -> None:
        if not (self._dirty or force):
            return
        self._dirty = False
        self._last_refresh = time.monotonic()
        self.header.value = self._header_html(final=self.status not in ("starting", "running"))
        for rank in sorted(self.ranks):
            state = self.ranks[rank]
            if rank not in self._row_widgets:
                label = w.HTML(layout=w.Layout(width="170px"))
                bar = w.FloatProgress(min=0.0, max=1.0, value=0.0, layout=w.Layout(width="260px"))
                latest = w.HTML(layout=w.Layout(flex="1"))
                self._row_widgets[rank] = (label, bar, latest)
                self.rows.children = self.rows.children + (w.HBox([label, bar, latest]),)
            label, bar, latest = self._row_widgets[rank]
            color = STATE_COLORS.get(state.state, "#888")
            label.value = (f"rank {rank} <span style='color:{color}'>{state.state}</span>"
                           + (f" {html.escape(state.desc)}" if state.desc else ""))
            if state.fraction is not None:
                bar.value = state.fraction
            bar.bar_style = {"done": "success", "failed": "danger", "stopped": "warning"}.get(state.state, "")
            latest.value = f"<code>{html.escape(state.latest[-200:])}</code>"
        self._refresh_panes(force)

    def _pane(self, key, title: str) -> w.HTML:
        if key not in self._pane_widgets:
            pane = w.HTML(layout=w.Layout(max_height="300px", overflow="auto"))
            self._pane_widgets[key] = pane
            self.tabs.children = self.tabs.children + (pane,)
            self.tabs.set_title(len(self.tabs.children) - 1, title)
        return self._pane_widgets[key]

    def _refresh_panes(self, force: bool = False) -> None:
        """Re-render the panes whose lines changed, at most once per pane_interval.

        All of them, not only the shown one: while a cell runs the kernel
        does not hear which tab the user picked.
        """
        now = time.monotonic()
        if not force and now - self._last_pane_refresh < self.pane_interval:
            return
        self._last_pane_refresh = now
        all_pane = self._pane("all", "all ranks")
        if self._all_dirty:
            self._all_dirty = False
            all_pane.value = _pre(self.all_lines)
        for rank in sorted(self.ranks):
            pane, state = self._pane(rank, f"rank {rank}"), self.ranks[rank]
            if state.pane_dirty:
                state.pane_dirty = False
                pane.value = _pre(state.lines)

    def close(self) -> None:
        """Close every widget model of this view (the kernel forgets them)."""
        for row in self.rows.children:
            for child in row.children:
                child.close()
            row.close()
        for pane in self._pane_widgets.values():
            pane.close()
        for widget in (self.header, self.rows, self.tabs, self.widget):
            widget.close()

    def summary_html(self) -> str:
        """The run's final state as static HTML: what the notebook keeps."""
        rows = []
        for rank in sorted(self.ranks):
            s = self.ranks[rank]
            color = STATE_COLORS.get(s.state, "#888")
            pct = 100 if s.state == "done" and s.fraction is None else int(round((s.fraction or 0) * 100))
            rows.append(
                f"<tr><td>rank {rank}</td><td style='color:{color}'>{s.state}</td>"
                f"<td><div style='width:160px;background:#eee'><div style='width:{pct}%;background:{color};"
                f"height:10px'></div></div></td><td>{pct}%</td><td><code>{html.escape(s.latest[-120:])}</code></td></tr>"
            )
        details = "".join(
            f"<details><summary>rank {rank} output ({self.ranks[rank].count} lines"
            f"{', last %d shown' % len(self.ranks[rank].lines) if self.ranks[rank].count > len(self.ranks[rank].lines) else ''})"
            f"</summary>{_pre(self.ranks[rank].lines)}</details>"
            for rank in sorted(self.ranks)
        )
        return (f"<div class='accel-magics-summary'>{self._header_html(final=True)}"
                f"<table>{''.join(rows)}</table>{details}</div>")


def _pre(lines) -> str:
    return "<pre style='margin:0;font-size:12px'>" + html.escape("\n".join(lines)) + "</pre>"
