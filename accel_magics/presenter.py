"""How one run is shown in the notebook: the live view, then the record.

``Presenter`` feeds the same engine events to every consumer of a run (the
live view and the plain-text record; the full log files are written by the
run's supervisor, in the directory named here) and, when the run ends,
replaces the live view with what the notebook keeps:

* widget mode: the live :class:`widgets.progress_view.RunView` is replaced by
  one output holding its final state as static HTML plus the plain-text record
  (``text/plain``), so nothing depends on widget state once the run is over.
  Beside the widget, the text view's latest lines live in an output that a
  widget manager hides (a widget view with no model, as a closed widget's
  output is) and a frontend without one (JupyterLab with the widget extension
  disabled or not installed, a plain Jupyter client) shows as text: the
  frontend picks, so no answer from it is awaited while the cell runs;
* text mode in a Jupyter kernel: the live display of the latest lines is
  emptied and the record is printed (grouped by rank: deterministic);
* a terminal: lines are printed live and nothing more.

Either way the output is shown once, and a saved, nbconvert-, papermill- or
nbval-executed notebook holds the record.
"""
from __future__ import annotations

import sys
import time
from typing import Optional

from accel_magics.kernel_ext.kernel import events as ev
from accel_magics.kernel_ext.kernel.errors import format_stacks

from .record import HEAD_LINES, TAIL_LINES, RunRecord
from .run_logs import run_log_dir
from .text_view import DisplayLive, StreamLive, TextView


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# What a widget manager renders as nothing: its renderer hides a view whose
# model_id is empty (jupyterlab_widgets, widgetsnbextension).
NO_WIDGET = {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": ""}}
NO_MANAGER_NOTE = ("[accel_magics] this frontend shows no widgets (ipywidgets' extension is missing or "
                   "disabled): the run's latest lines follow as text")


def widget_bundle(widget, text: str) -> dict:
    """``widget``'s display, with ``text`` where a frontend cannot render widgets."""
    return {WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}, "text/plain": text}


def text_beside_widgets() -> bool:
    """Whether a widget view gets the live text beside it (see the module's
    docstring).  Colab renders core widgets with its own manager, which is not
    known to hide an empty view: there, none."""
    return "google.colab" not in sys.modules


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class Presenter:
    def __init__(self, mode: str, in_kernel: bool, label: str, started: Optional[float] = None,
                 launcher_ready: bool = True, interactive: bool = True, background: bool = False,
                 note: str = "", context: str = "", expected: tuple = ()) -> None:
        if mode == "auto":
            mode = "widget" if in_kernel and interactive and widgets_available() else "text"
        if mode == "widget" and not in_kernel:
            mode = "text"
        self.mode = mode
        self.started = started if started is not None else time.monotonic()   # the cell's start: one clock
        self.log_dir = log_dir = run_log_dir(label)
        self.record = RunRecord(log_dir)
        self.view = None
        self.text = None
        self.expected: tuple = ()
        if mode == "widget":
            from IPython.display import display
            from accel_magics.widgets.progress_view import RunView

            self.view = RunView(log_dir=log_dir, started=started)
            if not launcher_ready:   # the first cell waits for it (torch import): say so at once
                self.view.note = "starting the launcher (it imports torch, once per kernel)"
                self.expected = tuple(expected)   # its ranks' rows, waiting for it
                self.view.expect(self.expected, "waiting for the launcher")
            if note:
                self.view.note = note
            self.view.context = context
            self.view.refresh(force=True)
            self.handle = display(widget_bundle(self.view.widget, NO_MANAGER_NOTE), raw=True, display_id=True)
            if text_beside_widgets():
                self.live = DisplayLive(extra=NO_WIDGET)
                self.text = TextView(self.live)
                if note:
                    self.live.write([f"[accel_magics] {note}"])
        else:
            self.live = DisplayLive() if in_kernel else StreamLive()
            self.text = TextView(self.live)
            if note:
                self.live.write([f"[accel_magics] {note}"])
        # A background run: its outputs are made now, in the cell that starts it,
        # and only updated later (from the run's thread, while other cells run).
        self.background = background and in_kernel
        self.stacks = ""   # where each rank was, when a background run was stopped
        if self.background and self.text is not None:
            self.live.open()

    @property
    def excerpt(self):
        """What the engine must send of each rank's lines (see ``run.execute``):
        every line where they are all printed (a terminal), else the record's
        head and tail, which also cover the live views' last lines."""
        if self.view is None and not self.live.keeps_record:
            return None
        return (HEAD_LINES, TAIL_LINES)

    def __call__(self, event) -> None:
        if self.background and isinstance(event, ev.RunFinished) and event.stacks:
            # Stopped (h.stop(), --timeout): a foreground cell's error shows
            # where each rank was; a background run's view must, at once.
            self.stacks = format_stacks(event.stacks).strip("\n")
            title, _, body = self.stacks.partition("\n")
            self.record.notes.append(f"[accel_magics] {event.status}; {title.strip('- ')}:\n{body}")
        self.record(event)
        if self.view is not None:
            self.view(event)
        if self.text is not None:
            self.text(event)

    def tick(self, phase: Optional[str] = None) -> None:
        """The cell waits (for the launcher, for the session's turn): the view's
        elapsed time moves on, so slow can be told from stuck; ``phase``: what
        the launcher does now ("importing torch"), said in the view."""
        if phase:
            note = f"starting the launcher (once per kernel): {phase}"
            if self.view is not None:
                self.view.note = note
                self.view.expect(self.expected, f"waiting for the launcher: {phase}")
            else:
                self.live.write([f"[accel_magics] {note}"])
        self(ev.Heartbeat())

    def not_started(self, exc: BaseException) -> None:
        """A background run that never started (its launcher failed, a check
        that needed it refused the flags, a stop while it started): the view
        says so and why, and becomes the record."""
        text = (str(exc).splitlines() or [type(exc).__name__])[0]
        if type(exc).__name__ not in text:
            text = f"{type(exc).__name__}: {text}"
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        self(ev.RunFinished("", status, time.monotonic() - self.started))
        if self.view is not None:
            self.view.error = text
        else:
            self.record.notes.append(f"[accel_magics] {text}")
        self.finish()

    def discard(self) -> None:
        """Nothing was launched (a usage error): take the view away again."""
        if self.text is not None:
            self.live.close()
        if self.view is not None:
            self.handle.update({"text/plain": ""}, raw=True)
            self.view.close()

    def finish(self) -> None:
        """The run is over (whatever its outcome): leave the record behind."""
        if self.view is not None and self.text is not None:
            self.live.close()   # the text beside the widget: its record follows
        if self.background:
            # Replaced in place (display update): a new output now would land
            # wherever the notebook is executing meanwhile.
            if self.view is not None:
                self.view.refresh(force=True)
                self.handle.update({"text/html": self.view.summary_html(self.stacks),
                                    "text/plain": self.record.render()}, raw=True)
                self.view.close()
            else:
                self.live.replace(self.record.render())
            return
        if self.view is not None:
            from IPython.display import display

            self.view.refresh(force=True)
            self.handle.update({"text/plain": ""}, raw=True)
            display({"text/html": self.view.summary_html(), "text/plain": self.record.render()}, raw=True)
            self.view.close()
        else:
            self.live.close()
            text = self.record.render() if self.live.keeps_record else ""
            if text:   # a quiet run adds nothing (and costs no flush round trip)
                sys.stdout.write(text)
                sys.stdout.flush()


def expected_ranks(num_processes, num_nodes, node_rank, config_file=None) -> tuple:
    """The ranks this node's run will have, where the cell's flags or the
    defaults say it before the launcher has counted the GPUs; () where they
    do not (the default is every GPU) or an Accelerate config file decides."""
    if not num_processes or config_file is not None:
        return ()
    node = (node_rank or 0) if (num_nodes or 1) > 1 else 0
    return tuple(range(node * num_processes, (node + 1) * num_processes))
