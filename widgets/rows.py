"""The live view's rows as HTML: the styles (inline only, see :data:`STYLE`),
a rank's state as the view keeps it, and a rank's row (state, resources, its
bars, its latest line or what it is busy with).  No widget: plain strings,
the record (static HTML) uses them too."""
from __future__ import annotations

import html
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from accel_magics.kernel_ext.clip import clip
from accel_magics.kernel_ext.kernel.events import DEBUGGER_PROMPT, bytes_text

STATE_COLORS = {"starting": "#888", "running": "#1f77b4", "done": "#2ca02c", "failed": "#d62728",
                "stopped": "#ff7f0e", "waiting": "#888", "paused": "#9467bd"}

PROGRESS_TAIL = 256   # progress is read from a line's last characters only: linear, bounded
OPEN_RECORD_LINES = 20   # the record shows a rank's output open up to this many lines, collapsed beyond

# Every style is inline, in values the notebook sanitizers keep: an untrusted
# notebook (opened from git, by a colleague, on another server) loses
# <style> elements and CSS variables, and a record styled by them fell apart.
# Theme-aware without variables: text colour is inherited, muted text is
# translucent and the bar track is a translucent grey, so light and dark
# themes both read.  Nothing has a fixed width; rows wrap.
MONO = "font-family:monospace;font-size:12px"
STYLE = {
    "row": "display:flex;flex-wrap:wrap;align-items:center;gap:2px 10px;margin:1px 0;font-size:13px;line-height:1.45",
    "label": "flex:0 0 auto;min-width:8.5em;white-space:nowrap",
    "bars": "flex:3 1 300px;min-width:160px;max-width:640px",
    "bar": "display:flex;align-items:center;gap:6px;min-width:0",
    "track": ("flex:0 0 auto;width:30%;min-width:60px;max-width:160px;height:9px;border-radius:2px;"
              "background-color:rgba(128,128,128,0.3);overflow:hidden"),
    "fill": "height:100%",
    # A bar's text and the latest line are cut with an ellipsis where there is
    # no room (a narrow window), whole in their tooltips (and the pane).
    "bartext": f"flex:1 1 auto;min-width:0;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;{MONO}",
    "latest": (f"flex:2 1 160px;min-width:0;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;{MONO};"
               "opacity:0.75"),
    # word-break:normal: JupyterLab's output CSS breaks <pre> lines anywhere ("loss 0.3 | 0").
    "pre": f"margin:0;padding:0;{MONO};line-height:1.35;white-space:pre-wrap;word-break:normal;overflow-wrap:anywhere",
    "muted": "opacity:0.75",
    "usage": f"flex:0 0 auto;white-space:nowrap;{MONO};opacity:0.75",
    "groups": "flex:2 1 200px;min-width:0;overflow-wrap:anywhere",
}
STYLE["aggregate"] = STYLE["row"]
ATTENTION_ROWS = 4   # the compact form shows at most this many ranks' own rows unfolded: failed, paused, then behind
# the aggregate's groups
STATE_ORDER = ("failed", "stopped", "paused", "behind", "running", "waiting", "starting", "done")
HEAD_LINES = 50   # the record keeps each rank's first lines too (the config, the first epoch, a warning)


def el(tag: str, part: str, body: str, extra: str = "", attrs: str = "") -> str:
    """An element of the view: its class (what tests and users' CSS can
    select) and its whole style inline (what survives a sanitizer)."""
    style = STYLE[part] + (";" + extra if extra else "")
    return f"<{tag} class='accel-magics-{part}' style='{style}'{attrs}>{body}</{tag}>"


# pdb's location line, printed before its prompt: "> /path/train.py(12)step()",
# with the return value after a "--Return--": "> /path/train.py(14)step()->None"
_PDB_WHERE = re.compile(r"> (?P<file>.+)\((?P<line>\d+)\)(?P<func>[^()]*)\(\)(?:->.*)?")


def paused_text(prompt: str, lines) -> str:
    """What a rank's row says while it waits at its prompt: the prompt, and
    for a debugger's prompt where it stopped (pdb's newest location line in
    ``lines`` and the source line under it: "in step (train.py:12): loss.backward()",
    the file's name without its directory)."""
    shown = prompt.strip()
    text = f"waits at its prompt {shown}" if shown else "waits for input"
    if not DEBUGGER_PROMPT.fullmatch(prompt):
        return text + " · type in the input box"
    recent = list(lines)
    for i in range(len(recent) - 1, -1, -1):
        found = _PDB_WHERE.fullmatch(recent[i])
        if found:
            text += f" in {found['func']} ({found['file'].rpartition('/')[2]}:{found['line']})"
            after = recent[i + 1] if i + 1 < len(recent) else ""
            if after.startswith("-> "):
                text += f": {after[3:].strip()}"
            break
    return text + " · type in the input box"


def parse_progress(text: str) -> Optional[tuple[float, str]]:
    """(fraction, description) from a tqdm-like carriage-return line, or None.

    Only a tqdm meter (``NN%|...|``) counts: an ``n/m`` in ordinary text
    ("loading shard 3/4") is not progress.  Linear and bounded: only the
    line's last ``PROGRESS_TAIL`` characters are read, with string searches.
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
    return None


@dataclass
class BarState:
    """One progress bar of a rank: a tqdm bar, ``accel_magics.progress`` or a
    carriage-return line that looks like a tqdm meter."""
    pos: int
    fraction: Optional[float]
    text: str
    order: int = 0
    closed: bool = False
    vacated: bool = False   # closed with leave=False: kept, unseen, until a bar takes its place (the row keeps its height)


@dataclass
class RankState:
    rank: int
    state: str = "starting"
    bars: dict = field(default_factory=dict)      # bar id -> BarState, on screen now
    latest: str = ""                              # the latest *printed* line
    failure: str = ""
    lines: deque = field(default_factory=deque)
    count: int = 0
    pane_dirty: bool = False
    bar_lines: deque = field(default_factory=lambda: deque(maxlen=64))   # final lines of closed bars
    head: list = field(default_factory=list)      # the first HEAD_LINES lines (the record keeps them)
    seqs: deque = field(default_factory=deque)    # each of ``lines``' arrival window (RunView._window)
    node: str = ""                                # the node it runs on (one kernel driving every node)
    phase: str = ""                               # what its cell is busy with ("importing accelerate"), ev.Phase
    expected: bool = False                        # a row shown before the run started (:meth:`RunView.expect`)
    usage: Optional[tuple] = None                 # (CPU %, resident bytes, GPU bytes, GPU % busy), the latest sample
    peak_rss: int = 0
    peak_gpu: Optional[int] = None
    paused: str = ""                              # while it waits at its prompt: what its row says (paused_text)

    def latest_printed(self) -> str:
        """The newest line the rank printed: not a finished bar's final line
        (the row shows the bar itself)."""
        for line in reversed(self.lines):
            if line not in self.bar_lines:
                return line
        return ""

    def shown_bars(self, slots: bool = False) -> list:
        """The bars on screen; with ``slots``, the places of inner bars between
        two epochs' too (a row keeps its height while the next one starts)."""
        return sorted((b for b in self.bars.values() if slots or not b.vacated), key=lambda b: (b.pos, b.order))


def bar_html(bar: BarState, color: str, hidden: bool = False) -> str:
    if bar.vacated or hidden:   # holds the place: the same height, nothing shown
        return el("div", "bar", el("div", "track", "") + el("span", "bartext", "&nbsp;"), "visibility:hidden")
    width = 0 if bar.fraction is None else int(round(bar.fraction * 100))
    fill = el("div", "fill", "", f"width:{width}%;background-color:{color}") if bar.fraction is not None else ""
    return el("div", "bar", el("div", "track", fill, attrs=f" title='{width}%'")
               + el("span", "bartext", html.escape(clip(bar.text, 300, keep="tail")),
                     attrs=f" title='{html.escape(clip(bar.text, 300, keep='tail'), quote=True)}'"))


def usage_html(s: RankState, final: bool, behind: bool) -> str:
    """The rank's resources: now (CPU, memory, GPU memory) while it runs, its
    peaks in the record; "behind" when it is far behind the others' progress."""
    parts = []
    if final and s.peak_rss:
        parts.append(f"peak {bytes_text(s.peak_rss)}" + (f", GPU {bytes_text(s.peak_gpu)}" if s.peak_gpu is not None else ""))
    elif not final and s.usage is not None:
        cpu, rss, gpu, busy = s.usage
        parts.append(f"cpu {cpu:.0f}% &middot; {bytes_text(rss)}" + (f" &middot; GPU {bytes_text(gpu)}" if gpu is not None else "")
                     + (f" {busy}% busy" if busy is not None else ""))
    if behind:
        parts.append("<b style='color:#ff7f0e'>behind</b>")
    return el("span", "usage", " &middot; ".join(parts)) if parts else ""


def row_html(s: RankState, final: bool = False, behind: bool = False) -> str:
    color = STATE_COLORS.get(s.state, "#888")
    bars = "".join(bar_html(b, color) for b in s.shown_bars(slots=not final))
    where = f" &middot; {html.escape(s.node)}" if s.node else ""
    return el("div", "row",
               el("span", "label", f"rank {s.rank}{where} <b style='color:{color}'>{html.escape(s.state)}</b>")
               + usage_html(s, final, behind)
               + (el("div", "bars", bars) if bars else "")
               + line_html(s, final, color))


def line_html(s: RankState, final: bool, color: str) -> str:
    """The row's line: its failure, where it waits at its prompt (paused),
    its latest printed line, or what it is busy with before it prints; one
    place, so the row keeps its height from one to the other."""
    latest = s.failure or s.latest
    if s.state == "paused" and not final:   # whole in the tooltip
        return el("span", "latest", html.escape(s.paused), f"font-style:italic;color:{color};opacity:1",
                  attrs=f" title='{html.escape(s.paused, quote=True)}'")
    if latest:
        # a span, not <code>: JupyterLab greys a record's <code> (an empty one was a grey bar)
        # a failure's line wraps, whole: an error cut by the window's width lost its type's name
        shown = clip(latest, 300, keep="head" if s.failure else "tail")   # an error's type leads it
        wrap = "white-space:normal;overflow-wrap:break-word" if s.failure else ""
        return el("span", "latest", html.escape(shown), wrap,
                  attrs=f" title='{html.escape(shown, quote=True)}'")
    if not final and s.state in ("running", "starting") and s.phase:
        return el("span", "latest", html.escape(s.phase + " …"), "font-style:italic",
                  attrs=" title='what the rank is busy with before it prints'")
    return ""


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def pre(lines) -> str:
    return el("pre", "pre", html.escape("\n".join(lines)))
