"""Plain events a run emits: the seam between the engine and its views.

The engine never prints or displays anything.  It hands these objects, in
order, to whatever consumer the caller gives it: the text view, the progress
widget, a test, a benchmark.  They hold only builtins so that any consumer can
use them without importing torch or IPython.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional


@dataclass
class RunStarted:
    run_id: str
    attempt: int            # 0 for the first attempt, +1 per restart
    max_restarts: int
    world_size: int
    num_nodes: int
    node_rank: int
    ranks: list[int]        # global ranks that run on this node
    master_addr: str
    master_port: int
    pids: dict[int, int] = field(default_factory=dict)  # rank -> pid
    nodes: dict[int, str] = field(default_factory=dict)  # rank -> node name (one kernel driving every node)

    def placement(self) -> str:
        """Which ranks run on which node: 'n1: ranks 0-1, n2: ranks 2-3' ('' on one node)."""
        by_node: dict = {}
        for rank, node in sorted(self.nodes.items()):
            by_node.setdefault(node, []).append(rank)
        return ", ".join(f"{node}: {ranks_label(r)}" for node, r in by_node.items())


@dataclass
class Output:
    """Complete lines a rank wrote to stdout/stderr (fd level), in order.

    ``text`` holds the lines joined by newlines (no trailing newline): a rank
    can print hundreds of thousands of lines, and most consumers need the
    block, or its last lines, not a list of every line.
    """
    rank: int
    text: str
    omitted: int = 0   # lines written just before ``text`` that only the log file has

    @property
    def lines(self) -> list[str]:
        return self.text.split("\n")

    def last_lines(self, n: int) -> list[str]:
        return self.text.rsplit("\n", n)[-n:]

    @cached_property
    def count(self) -> int:
        """Lines the rank wrote, the omitted ones included (the record and the
        views all need it: counted once)."""
        return self.text.count("\n") + 1 + self.omitted


@dataclass
class ProgressLine:
    """The current state of a carriage-return line (tqdm and friends).

    Only the latest state is sent; the line becomes an :class:`Output` line
    once the rank ends it with a newline.
    """
    rank: int
    text: str


@dataclass
class Progress:
    """Structured progress from :func:`accel_magics.progress` or tqdm."""
    rank: int
    n: float
    total: Optional[float]
    desc: str = ""


@dataclass
class Phase:
    """What a rank's cell is busy with, seen once a heartbeat (``rank/startup.py``):
    "importing accelerate", "in init_process_group"; '' when its own code runs."""
    rank: int
    text: str


@dataclass
class Bar:
    """A tqdm bar in a rank (``kernel_ext.rank.rank_bars``): its latest state.

    ``pos`` is its nesting (0: outermost); a closed bar that is not ``leave``
    is gone from the screen, a closed ``leave`` bar stays in its final state."""
    rank: int
    id: int
    pos: int
    desc: str
    n: float
    total: Optional[float]
    stats: str              # tqdm's statistics: "50/300 [00:02<00:12, 19.87it/s, loss=0.1]"
    leave: bool = True
    closed: bool = False
    line: str = ""          # the bar as tqdm draws it, "epoch: 100%|██████████| 3/3 [...]" (the rank's)

    @property
    def fraction(self) -> Optional[float]:
        return min(1.0, self.n / self.total) if self.total else None

    @property
    def terminal_line(self) -> str:
        """The bar as a terminal keeps it, meter and all (a bar left on screen
        when closed: the rank writes this line into its output itself, in
        order with its prints; see ``rank_bars.line``)."""
        return self.line or self.text

    @property
    def text(self) -> str:
        """The bar without its meter: what a row shows beside the bar it draws."""
        pct = f"{int(100 * self.fraction)}% " if self.fraction is not None else ""
        return f"{self.desc + ': ' if self.desc else ''}{pct}{self.stats}"


@dataclass
class RankFailure:
    """Why one rank failed, as seen from inside that rank where possible."""
    rank: int
    kind: str               # "exception", "exit", "signal", "lost"
    summary: str            # one line: "ValueError: boom", "killed by SIGSEGV"
    traceback: str = ""     # the rank's own formatted traceback, if any
    timestamp: float = 0.0  # time.time() when the failure happened in the rank
    secondary: bool = False  # looks like a consequence of another rank failing


@dataclass
class RankExited:
    rank: int
    exitcode: Optional[int]      # None when killed by a signal
    signal: Optional[str]        # "SIGKILL", ...
    stopped: bool                # ended by the supervisor's stop, not by itself
    failure: Optional[RankFailure] = None


@dataclass
class RankHeld:
    """A rank failed and is held as it failed, for ``%distributed_debug``,
    for at most ``seconds`` (it exits after the run, not before)."""
    rank: int
    seconds: float
    failure: Optional[RankFailure] = None


@dataclass
class RankStacks:
    """Where a rank was (all Python threads) when the run was stopped."""
    rank: int
    text: str


@dataclass
class RunFinished:
    run_id: str
    status: str                  # "ok", "failed", "interrupted", "timeout"
    elapsed: float
    root_cause: Optional[RankFailure] = None
    failures: list[RankFailure] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)


@dataclass
class Heartbeat:
    """Nothing arrived for a while; views may refresh what they throttled."""


def bytes_text(n: Optional[int]) -> str:
    """``512.0 MB``: how every view and ``%distributed_session status`` write
    an amount of memory ("-" for unknown)."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


COMPACT_RANKS = 4   # views fold more ranks than this (8 ranks were 16 bar rows, 8 tabs and a 2,700 px record)


_BAR_STATS = re.compile(r"\s*\[([^\[\]]*)\]\s*$")
_TIME_OR_RATE = re.compile(r"[\d:]+<[\d:?]*|\??[\d.]*\s*[a-zA-Z]*/s|\??[\d.]*\s*s/[a-zA-Z]+")


def without_times(bar_line: str) -> str:
    """A finished tqdm bar's line without its elapsed and remaining time and
    its rate (its postfix, ``loss=0.1``, stays): what views compare when they
    fold ranks that printed the same."""
    m = _BAR_STATS.search(bar_line)
    if not m:
        return bar_line
    kept = [part for part in m.group(1).split(",") if not _TIME_OR_RATE.fullmatch(part.strip())]
    return bar_line[:m.start()] + (f" [{','.join(kept).strip()}]" if kept else "")


def rank_runs(ranks) -> str:
    """``0-5, 7``: ranks with runs of consecutive ones folded, so 64 ranks
    stay one short line."""
    ranks = sorted(set(ranks))
    runs, start = [], ranks[0] if ranks else None
    for prev, rank in zip(ranks, ranks[1:] + [None]):
        if rank is None or rank != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = rank
    return ", ".join(runs)


def ranks_label(ranks) -> str:
    """``rank 3``, ``ranks 0-5, 7``: a set of ranks as the views write it."""
    ranks = set(ranks)
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + rank_runs(ranks)


@dataclass
class Resources:
    """What each running rank uses now, sampled by its supervisor from /proc
    (and NVML where there is an NVIDIA GPU; never CUDA): rank -> (CPU percent
    of one core, resident bytes, GPU bytes or None, GPU percent busy or None;
    a sender of three fields has no utilisation)."""
    ranks: dict


#: A debugger's prompt, as a rank's unfinished line before it reads its stdin:
#: ``(Pdb) ``, ``(ipdb) ``, ``(Pdb++) ``.
DEBUGGER_PROMPT = re.compile(r"\(([A-Za-z][\w-]{0,15})\) ?")


@dataclass
class InputRequested:
    """A rank reads its stdin (``input()``, a ``breakpoint()``'s pdb): it is
    paused until the kernel answers (the notebook's input box), and its peers
    wait for it as they would under a terminal."""
    rank: int
    prompt: str


@dataclass
class InputAnswered:
    """What was typed for a rank (None: end of input, ``why`` says why): the
    transcript of a debugger session, in the record and the text view."""
    rank: int
    prompt: str
    line: Optional[str]
    why: str = ""

    def transcript(self) -> str:
        """The exchange as a terminal shows it: the prompt and what was typed."""
        if self.line is None:
            return f"{self.prompt}<end of input: {self.why or 'none given'}>"
        return f"{self.prompt}{self.line}"

    def text(self) -> str:
        return f"[rank {self.rank}] {self.transcript()}"


@dataclass
class Quiet:
    """Ranks use no CPU and print nothing after a peer finished the cell, but
    are not stuck (they sleep, wait for a subprocess or a socket): the run goes
    on, and the user is told once where each waits."""
    ranks: list[int]
    seconds: float
    finished: list[int]
    where: dict[int, str]

    def text(self) -> str:
        places = "; ".join(f"rank {rank} in {self.where.get(rank, '?')}" for rank in self.ranks)
        return (f"rank(s) {', '.join(map(str, self.ranks))} have used no CPU and printed nothing for "
                f"{self.seconds:g}s since rank(s) {', '.join(map(str, self.finished))} finished the cell; "
                f"not stuck ({places}), so the run goes on (--timeout bounds a cell)")


@dataclass
class Waiting:
    """Nodes are still joining the rendezvous (multi-node runs)."""
    joined: int
    expected: int
    address: str
    problem: str = ""   # what is wrong meanwhile: node 0 refuses connections, a second node 0 tried, ...

    def text(self) -> str:
        waiting = f"waiting for {self.expected - self.joined} of {self.expected} nodes at {self.address}"
        return f"{waiting}: {self.problem}" if self.problem else waiting
