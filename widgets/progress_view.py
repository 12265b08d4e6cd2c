"""The live progress view of one run, as ipywidgets, fed plain engine events.

Layout: a header (world size, nodes, master, elapsed time since the cell
started, overall state), one row per rank (state, its progress bars, nested
tqdm bars as nested bars, and its latest *printed* line) and the ranks'
output in tabs: "all ranks" interleaved, then one tab per rank, each
following its newest line.  Widths are flexible and colours come from the
theme, so narrow windows and dark themes read as well as wide light ones.  Memory is bounded: the
panes keep the last ``max_lines`` lines; the full logs live in files (the
header shows where).

Events only update Python-side state; widget traits are written by
:meth:`refresh`, at most once per ``interval`` (and when the run ends), so a
rank printing 100k lines costs a few comm messages per second, like
ipykernel's stream batching.  :meth:`summary_html` renders the final state as
static HTML, which the notebook keeps after the run (no widget state needed).

Many ranks (more than ``COMPACT_RANKS``) get a compact form: one aggregate
row (the ranks grouped by state, the slowest and the fastest rank's
progress, the memory of all), the rows of the ranks that need a look (failed,
behind), and every rank's row and pane folded away, opened on demand in the
browser (the kernel is busy while a cell runs: nothing on demand may need
it).  The record folds ranks whose output is the same ("ranks 1-7 output").

The rows' HTML (styles, a rank's state, its row) is :mod:`widgets.rows`.
This module imports ipywidgets and, from the engine, only how an amount of
memory and a set of ranks are written (``events.bytes_text``,
``events.ranks_label``), when ranks are many, and which are behind
(``behind.Behind``, judged on time); events are duck-typed by class name.
"""
from __future__ import annotations

import html
import time
from collections import deque
from typing import Optional

import ipywidgets as w

from accel_magics.kernel_ext.kernel.behind import Behind
from accel_magics.kernel_ext.timing import PANE_INTERVAL, VIEW_REFRESH
from accel_magics.kernel_ext.kernel.events import COMPACT_RANKS

from .aggregate import aggregate_html, attention
from .output import merged_lines, output_html, same_key
from .rows import (HEAD_LINES, STATE_COLORS, STYLE, BarState, RankState, parse_progress, paused_text, plural, pre,
                   row_html)

class RunView:
    """One run's live view. Call it with events; display :attr:`widget`."""

    def __init__(self, max_lines: int = 100, interval: float = VIEW_REFRESH, pane_interval: float = PANE_INTERVAL,
                 log_dir: str = "", started: Optional[float] = None, clock=time.monotonic) -> None:
        self.max_lines = max_lines
        self.interval = interval
        self.pane_interval = pane_interval
        self.log_dir = log_dir
        self.ranks: dict[int, RankState] = {}
        self._window = 0   # pane refreshes so far: lines arriving between two are one window (the merged pane)
        self.status = "starting"
        self.world = ""
        self.attempt = ""
        self.started = started if started is not None else time.monotonic()   # the cell's start
        self.elapsed = 0.0
        self.error = ""
        self.world_note = ""
        self.quiet_note = ""   # ranks quiet but not stuck (ev.Quiet): said under the header
        self._last_refresh = 0.0
        self._dirty = True
        self._bar_order = 0
        self.clock = clock   # when bars move: "behind" is judged on time
        self.behind = Behind()
        self.note = ""      # what happens before the run starts ("starting the launcher")
        self.context = ""   # where it runs, for the whole run ("on the session: its cell 3")

        # display:block: ipywidgets lays an HTML widget's content out as a flex
        # item that cannot shrink below its content's min-content width, so a
        # row with a long latest line ran past a narrow output area, clipped.
        self.header = _html_widget()
        self.rows = _html_widget()
        self.tabs = w.Tab()
        self.widget = w.VBox([self.header, self.rows, self.tabs], layout=w.Layout(width="100%"))
        # The compact form's fold (many ranks): every row and each rank's pane.
        self.compact = False
        self.every = _html_widget()
        self.rank_tabs = self.tabs
        self.fold: Optional[w.Accordion] = None
        self.widget.add_class("accel-magics-run")
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

    def _rank(self, rank: int) -> RankState:
        if rank not in self.ranks:
            self.ranks[rank] = RankState(rank, lines=deque(maxlen=self.max_lines),
                                          seqs=deque(maxlen=self.max_lines))
            if len(self.ranks) > COMPACT_RANKS and not self.compact:
                self._go_compact()
        return self.ranks[rank]

    def _go_compact(self) -> None:
        """Many ranks: rows and per-rank panes move into a fold the user opens
        in the browser (an Accordion opens without the busy kernel)."""
        self.compact = True
        self.rank_tabs = w.Tab()
        self.fold = w.Accordion(children=[w.VBox([self.every, self.rank_tabs])], selected_index=None)
        self.fold.add_class("accel-magics-fold")
        self.widget.children = (self.header, self.rows, self.tabs, self.fold)

    def _set_bar(self, state: RankState, key, pos: int, fraction: Optional[float], text: str,
                 n: Optional[float] = None, total: Optional[float] = None, closed: bool = False) -> None:
        if n is None and fraction is not None:
            n, total = fraction * 100, 100
        if n is not None:
            self.behind.bar(self.clock(), state.rank, key, pos, n, total, closed)
        if key not in state.bars:
            for other in [k for k, b in state.bars.items() if b.vacated and b.pos == pos]:
                del state.bars[other]   # the new bar takes the place its predecessor kept
            self._bar_order += 1
            state.bars[key] = BarState(pos, fraction, text, self._bar_order)
        else:
            bar = state.bars[key]
            bar.pos, bar.fraction, bar.text = pos, fraction, text

    def on_RunStarted(self, e) -> None:
        self.status, self.note = "running", ""
        nodes = f"node {e.node_rank} of {e.num_nodes}" if e.num_nodes > 1 else "1 node"
        if getattr(e, "nodes", None):
            nodes = f"{e.num_nodes} nodes ({e.placement()})"
        self.world = (f"{plural(len(e.ranks), 'rank')} on {nodes} "
                      f"(world size {e.world_size}; ranks {e.ranks[0]}-{e.ranks[-1]}), "
                      f"master {e.master_addr}:{e.master_port}")
        self.attempt = f"attempt {e.attempt + 1} of {e.max_restarts + 1}" if e.max_restarts else ""
        if e.num_nodes > 1:
            self.status = "waiting"
            self.world_note = f"rendezvous at {e.master_addr}:{e.master_port}"
        for rank in [r for r, s in self.ranks.items() if s.expected and r not in e.ranks]:
            del self.ranks[rank]   # expected before the run, not among its ranks after all
        for rank in e.ranks:
            state = self._rank(rank)
            state.expected = False
            state.state, state.latest, state.failure, state.phase, state.paused = "running", "", "", "", ""
            state.node = (getattr(e, "nodes", None) or {}).get(rank, "")
            state.bars.clear()
            self.behind.reset(rank)

    def on_Output(self, e) -> None:
        if self.status == "waiting":
            self.status = "running"
        self._printed(self._rank(e.rank), e.text, e.last_lines(self.max_lines), e.count, e.omitted)

    def _printed(self, state: RankState, text: str, lines: list, count: int, omitted: int = 0) -> None:
        """Lines of the rank's output: ``text`` all ``count`` of them (less
        ``omitted``), ``lines`` the last ones, what the panes can show."""
        room = HEAD_LINES - len(state.head)
        if room > 0 and not omitted and state.count == len(state.head):   # the head: the first lines, in a row
            state.head.extend(text.split("\n", room)[:room])
        state.lines.extend(lines)
        state.seqs.extend([self._window] * len(lines))
        state.count += count
        state.latest = state.latest_printed()
        state.pane_dirty = self._all_dirty = True
        # A carriage-return line that was then ended by a newline is printed text now.
        state.bars.pop("cr", None)

    def on_ProgressLine(self, e) -> None:
        """A line a rank rewrites with carriage returns (progress not drawn by tqdm)."""
        state = self._rank(e.rank)
        parsed = parse_progress(e.text)
        self._set_bar(state, "cr", 1000, parsed[0] if parsed else None, e.text.strip())

    def on_Progress(self, e) -> None:
        state = self._rank(e.rank)
        fraction = min(1.0, e.n / e.total) if e.total else None
        text = f"{e.desc + ': ' if e.desc else ''}{e.n:g}{'/%g' % e.total if e.total else ''}"
        self._set_bar(state, "api", 999, fraction, text, e.n, e.total)

    def on_Bar(self, e) -> None:
        state = self._rank(e.rank)
        if e.closed:
            for key, bar in list(state.bars.items()):
                if bar.vacated and bar.pos > e.pos:
                    del state.bars[key]   # its loop is over: no bar comes to take the place
        if e.closed and not e.leave:
            # Gone from the screen, as in a terminal; its place kept until the
            # next bar at its position (the next epoch's) takes it.
            self._set_bar(state, e.id, e.pos, e.fraction, e.text, e.n, e.total, True)
            state.bars[e.id].vacated = True
            return
        if e.closed:
            # Left on screen: its final line arrives in the rank's output (in
            # order with its prints); the row keeps only the newest finished
            # bar per position (a leave=True inner bar per epoch stays bounded).
            state.bar_lines.append(e.terminal_line)
            state.latest = state.latest_printed()
            for key, bar in list(state.bars.items()):
                if key != e.id and bar.pos == e.pos and getattr(bar, "closed", False):
                    del state.bars[key]
        self._set_bar(state, e.id, e.pos, e.fraction, e.text, e.n, e.total, e.closed)
        state.bars[e.id].closed = e.closed

    def on_InputRequested(self, e) -> None:
        """The rank waits at its prompt (a breakpoint's pdb, ``input()``): its
        row says so, and where, until it is answered.  Shown now: the kernel
        waits in the input box next, and refreshes nothing until it is answered."""
        state = self._rank(e.rank)
        if state.state in ("running", "starting"):
            state.state = "paused"
            state.paused = paused_text(e.prompt, state.lines)
        self.refresh(force=True)

    def on_InputAnswered(self, e) -> None:
        """Answered: the exchange is a line of the rank's output (the debugger
        session's transcript, in its pane and the record) and it runs again."""
        state = self._rank(e.rank)
        if state.state == "paused":
            state.state = "running"
        state.paused = ""
        line = e.transcript()
        self._printed(state, line, [line], 1)

    def expect(self, ranks, phase: str) -> None:
        """Before the run starts (the first cell waits for the launcher): a
        row for each rank it will have, saying what they wait for."""
        for rank in ranks:
            if rank not in self.ranks:
                self._rank(rank).expected = True
            state = self.ranks[rank]
            if state.expected:
                state.phase = phase
        self._dirty = True

    def on_Phase(self, e) -> None:
        self._rank(e.rank).phase = e.text

    def on_RankHeld(self, e) -> None:
        """It failed; it is kept for %distributed_debug (its exit comes after the run)."""
        state = self._rank(e.rank)
        self.behind.ended(e.rank)
        state.state = "failed"
        if e.failure is not None:
            state.failure = f"{e.failure.summary} (held for %distributed_debug)"

    def on_RankExited(self, e) -> None:
        state = self._rank(e.rank)
        self.behind.ended(e.rank)
        if e.failure is not None:
            state.state = "failed"
            state.failure = e.failure.summary
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
        self.world_note = e.text()

    def on_Quiet(self, e) -> None:
        self.quiet_note = e.text()
        self._dirty = True

    def on_Heartbeat(self, e) -> None:
        self._dirty = True   # elapsed time moves on

    # -- rendering -------------------------------------------------------------
    def _header_html(self, final: bool = False) -> str:
        elapsed = self.elapsed if final else time.monotonic() - self.started
        # A rank at its prompt pauses the run (the others wait for it): the header says so, and who.
        paused = [] if final or self.status != "running" else sorted(
            rank for rank, state in self.ranks.items() if state.state == "paused")
        status = "paused" if paused else self.status
        color = STATE_COLORS.get({"ok": "done"}.get(status, status), "#d62728")
        world = html.escape(self.world or self.note or "starting the ranks")
        if self.status == "waiting":
            world += " &middot; " + html.escape(self.world_note)
        parts = [f"<b style='color:{color}'>{html.escape(status)}</b>", world,
                 f"{elapsed:.1f} s"]
        if paused:
            parts.append((f"rank {paused[0]} waits at its prompt" if len(paused) == 1 else
                          f"ranks {', '.join(map(str, paused))} wait at their prompts") + ": type in the input box")
        if self.context:
            parts.append(html.escape(self.context))
        if self.attempt:
            parts.append(html.escape(self.attempt))
        text = " &middot; ".join(parts)
        if self.quiet_note:   # kept in the record: a long quiet wait is part of the run's story
            text += f"<br><span style='{STYLE['muted']}'>{html.escape(self.quiet_note)}</span>"
        if self.error:
            text += f"<br><span style='color:#d62728'>{html.escape(self.error)}</span>"
        if self.log_dir:
            text += (f"<br><small style='{STYLE['muted']}'>full logs (on this machine; the newest 20 runs are "
                     f"kept): <code>{html.escape(self.log_dir)}</code></small>")
        return f"<div class='accel-magics-header' style='line-height:1.45'>{text}</div>"

    def _rows_html(self, final: bool = False) -> str:
        """Every rank's row; in the compact form the aggregate row and the
        rows that need a look (the others are in :meth:`_every_html`)."""
        behind = set() if final else self.stragglers()
        if not self.compact:
            return self._every_html(final, behind)
        return aggregate_html(self.ranks, final, behind) + "".join(
            row_html(self.ranks[rank], final, rank in behind) for rank in attention(self.ranks, behind))

    def _every_html(self, final: bool, behind: set) -> str:
        return "".join(row_html(self.ranks[rank], final, rank in behind) for rank in sorted(self.ranks))

    def stragglers(self) -> set:
        """Ranks still running that most ranks are well ahead of, in time (a
        slow GPU, a bigger shard): the row says so (``behind.Behind``)."""
        return {rank for rank in self.behind.judge(self.clock())
                if rank in self.ranks and self.ranks[rank].state in ("running", "starting")}

    def on_Resources(self, e) -> None:
        for rank, sample in e.ranks.items():
            cpu, rss, gpu, busy = (*sample, None)[:4]
            s = self._rank(rank)
            s.usage = (cpu, rss, gpu, busy)
            s.peak_rss = max(s.peak_rss, rss or 0)
            if gpu is not None:
                s.peak_gpu = max(s.peak_gpu or 0, gpu)

    def refresh(self, force: bool = False) -> None:
        if not (self._dirty or force):
            return
        self._dirty = False
        self._last_refresh = time.monotonic()
        self.header.value = self._header_html(final=self.status not in ("starting", "running", "waiting"))
        rows = self._rows_html()
        if rows != self.rows.value:
            self.rows.value = rows
        if self.compact:
            every = self._every_html(False, self.stragglers())
            if every != self.every.value:
                self.every.value = every
            self.fold.set_title(0, f"each of the {len(self.ranks)} ranks: its row and its output")
        self._refresh_panes(force)

    def _pane(self, key, title: str) -> w.HTML:
        if key not in self._pane_widgets:
            # column-reverse: the browser keeps the pane scrolled to its newest
            # line (it follows the output) unless the user scrolled up.
            pane = w.HTML(layout=w.Layout(max_height="300px", overflow="auto", display="flex",
                                          flex_flow="column-reverse"))
            pane.add_class("accel-magics-pane")
            self._pane_widgets[key] = pane
            tabs = self.tabs if key == "all" else self.rank_tabs
            tabs.children = tabs.children + (pane,)
            tabs.set_title(len(tabs.children) - 1, title)
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
        self._window += 1
        all_pane = self._pane("all", "all ranks")
        if self._all_dirty:
            self._all_dirty = False
            all_pane.value = pre(self.merged_lines())
        for rank in sorted(r for r, s in self.ranks.items() if not s.expected):
            pane, state = self._pane(rank, f"rank {rank}"), self.ranks[rank]
            if state.pane_dirty:
                state.pane_dirty = False
                pane.value = pre(state.lines)

    def merged_lines(self) -> list[str]:
        """The "all ranks" pane's lines (see :func:`.output.merged_lines`)."""
        return merged_lines(self.ranks, self.max_lines)

    def close(self) -> None:
        """Close every widget model of this view, their layout and style models
        too (the kernel forgets them, and a notebook saved or executed headless
        keeps no state of a view it no longer shows)."""
        parts = (*self._pane_widgets.values(), self.header, self.rows, self.every, self.tabs, self.widget)
        if self.fold is not None:
            parts += (self.rank_tabs, *self.fold.children, self.fold)
        for widget in parts:
            for part in (getattr(widget, "layout", None), getattr(widget, "style", None)):
                if part is not None:
                    part.close()
            widget.close()

    def summary_html(self, stacks: str = "") -> str:
        """The run's final state as static HTML: what the notebook keeps.

        Per rank its row (state, the bars left on screen, its latest printed
        line) and its printed lines: shown open when short, collapsed with
        their count when long; a long output keeps its first and its last
        lines, saying how many it left out between them (the log has all).
        Ranks whose output is the same are one block ("ranks 1-7 output").
        Many ranks: the aggregate row and the rows that need a look, every
        row in a fold.  ``stacks``: where each rank was when it was stopped
        (a background run: no error is raised in its cell), shown open.
        Styled inline only: it reads the same untrusted (see :data:`STYLE`)."""
        outputs: dict[tuple, list[int]] = {}
        for rank in sorted(self.ranks):
            s = self.ranks[rank]
            if s.count:
                outputs.setdefault(same_key(s), []).append(rank)
        details = [output_html(self.ranks, ranks, self.ranks[ranks[0]], self.log_dir) for ranks in outputs.values()]
        every = ""
        if self.compact:
            every = (f"<details><summary>each of the {len(self.ranks)} ranks' rows</summary>"
                     f"{self._every_html(True, set())}</details>")
        where = ""
        if stacks:
            title, _, body = stacks.partition("\n")
            where = f"<details open><summary>{html.escape(title.strip('- '))}</summary>{pre(body.splitlines())}</details>"
        return (f"<div class='accel-magics-summary'>{self._header_html(final=True)}"
                f"{self._rows_html(final=True)}{every}{where}{''.join(details)}</div>")



def _html_widget() -> w.HTML:
    return w.HTML(layout=w.Layout(display="block"))

