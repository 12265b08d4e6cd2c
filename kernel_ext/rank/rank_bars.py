"""tqdm bars as events (in a rank): what each bar is, not what it draws.

A tqdm bar drawn into a pipe is a stream of carriage returns, padding and
cursor-up escapes (nested bars); interpreted after the fact it garbles the
view, and a print inside the loop lands glued to the bar text.  So in a rank
every ``tqdm.std.tqdm`` (and so ``tqdm.auto``, Accelerate's, transformers',
datasets' and Lightning's bars, which all derive from it) that would draw on
the rank's stdout/stderr draws nothing and reports instead, as ``bar``
events: its position (nesting), desc, n, total, the formatted statistics,
whether it is left on screen when closed.  Prints (and ``tqdm.write``) stay
clean lines of their own.  A bar drawn into another file (``file=f``) is
left alone.

Events are throttled per bar (``INTERVAL``); the latest state of every bar is
always sent before the rank reports its result (:func:`flush`).  The patch is
installed when the cell starts, on tqdm if it is imported already, else by
an import hook the moment ``tqdm.std`` is imported.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import weakref
from typing import Callable, Optional

from .. import hooks
from ..timing import BAR_INTERVAL as INTERVAL

_emit: Optional[Callable[[dict], bool]] = None
_owner = 0                 # the rank's pid: a process it forks (a DataLoader worker) draws as tqdm does
_ids = itertools.count(1)
_pending: dict = {}        # bar id -> latest unsent event
_last_sent: dict = {}      # bar id -> time.monotonic() of its last event
_lock = threading.RLock()
_open: "weakref.WeakSet" = weakref.WeakSet()   # reporting bars not closed yet


class _Nowhere:
    """The file a reporting bar draws into: nothing, so no escape reaches the output."""

    def write(self, s) -> int:
        return len(s)

    def flush(self) -> None:
        pass


_NOWHERE = _Nowhere()


def _stats(bar) -> str:
    """tqdm's own statistics text: ``50/300 [00:02<00:12, 19.87it/s, loss=0.1]``."""
    try:
        d = dict(bar.format_dict)
        d["bar_format"] = "{n_fmt}" + ("/{total_fmt}" if d.get("total") else "") + \
            " [{elapsed}" + ("<{remaining}" if d.get("total") else "") + ", {rate_fmt}{postfix}]"
        d["ncols"] = None
        return bar.format_meter(**d)
    except Exception:
        return f"{bar.n}"


def _event(bar, closed: bool = False) -> dict:
    try:
        total = float(bar.total) if bar.total else None
    except (TypeError, ValueError):
        total = None
    if total is not None and (total != total or total == float("inf")):
        total = None
    event = {"kind": "bar", "id": bar._accel_bar, "pos": abs(getattr(bar, "pos", 0) or 0),
             "desc": str(bar.desc or "").rstrip(": "), "n": _number(bar.n), "total": total,
             "stats": _stats(bar), "leave": bool(bar.leave if bar.leave is not None else bar.pos == 0),
             "closed": closed}
    event["line"] = line(event)   # what a terminal shows: the text views and the record write it
    return event


_BLOCKS = " ▏▎▍▌▋▊▉█"   # tqdm's unicode bar: eighths of a cell
BAR_WIDTH = 10          # tqdm's bar when it knows no terminal width


def line(event: dict) -> str:
    """A bar as the line a terminal keeps of it, as tqdm draws it:
    ``epoch: 100%|██████████| 3/3 [00:00<00:00, 9.9it/s]`` (no meter without
    a total).  The view's rows show :attr:`events.Bar.text` beside a drawn bar."""
    total = event.get("total")
    desc = f"{event['desc']}: " if event["desc"] else ""
    if not total:
        return f"{desc}{event['stats']}"
    fraction = max(0.0, min(1.0, event["n"] / total))
    eighths = int(fraction * BAR_WIDTH * 8)
    full, part = divmod(eighths, 8)
    bar = (_BLOCKS[-1] * full + (_BLOCKS[part] if full < BAR_WIDTH else "")).ljust(BAR_WIDTH)
    return f"{desc}{100 * fraction:3.0f}%|{bar}| {event['stats']}"


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _report(bar, closed: bool = False, event: Optional[dict] = None) -> None:
    """Never raises into the user's loop: a bar that cannot be reported is not."""
    try:
        _send_report(bar, closed, event)
    except Exception:
        pass


def _send_report(bar, closed: bool, event: Optional[dict]) -> None:
    if _emit is None or os.getpid() != _owner:
        return
    event = event or _event(bar, closed)
    now = time.monotonic()
    with _lock:
        due = closed or bar._accel_bar not in _last_sent or now - _last_sent[bar._accel_bar] >= INTERVAL
        if not due:
            _pending[bar._accel_bar] = event
            return
        _pending.pop(bar._accel_bar, None)
        _last_sent[bar._accel_bar] = now
        if closed:
            _last_sent.pop(bar._accel_bar, None)
    _emit(event)


def stop() -> None:
    """The rank reported its result: nothing more is sent."""
    global _emit
    _emit = None


def flush() -> None:
    """Send the current state of every bar still open (tqdm itself draws at most
    every ``mininterval``: its last updates may never have been displayed)."""
    with _lock:
        _pending.clear()
        bars = [bar for bar in list(_open) if not getattr(bar, "disable", True)]
    for bar in bars:
        if _emit is not None:
            try:
                _emit(_event(bar))
            except Exception:   # a bar half torn down: its last event stands
                pass


def unsupported(tqdm_cls) -> Optional[str]:
    """The ``tqdm`` hook's guard, for a tqdm class: what the patch wraps and reads."""
    for name in ("__init__", "display", "close", "format_dict"):
        if not hasattr(tqdm_cls, name):
            return f"tqdm's {tqdm_cls.__name__} has no {name}"
    return None


def _patch(tqdm_cls) -> None:
    if getattr(tqdm_cls, "_accel_patched", False) or not hooks.enabled("tqdm"):
        return
    why = unsupported(tqdm_cls)
    if why:
        hooks.step_aside("tqdm", why)
        return
    original_init, original_display, original_close = tqdm_cls.__init__, tqdm_cls.display, tqdm_cls.close

    def __init__(self, *args, **kwargs):
        file = kwargs.get("file", args[4] if len(args) > 4 else None)
        ours = file is None or file in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        if ours and _emit is not None and os.getpid() == _owner:
            self._accel_bar = next(_ids)
            if len(args) > 4:
                args = args[:4] + (_NOWHERE,) + args[5:]
            else:
                kwargs["file"] = _NOWHERE
        original_init(self, *args, **kwargs)
        if getattr(self, "_accel_bar", None) is not None and not self.disable:
            _open.add(self)

    def display(self, msg=None, pos=None):
        if getattr(self, "_accel_bar", None) is None:
            return original_display(self, msg, pos)
        if msg is None:   # msg '' is tqdm clearing the bar: its close says so
            _report(self)
        return True

    def close(self):
        reporting = getattr(self, "_accel_bar", None) is not None and not getattr(self, "disable", True) \
            and os.getpid() == _owner and _emit is not None
        original_close(self)
        _open.discard(self)
        if reporting:
            try:
                event = _event(self, closed=True)
            except Exception:
                return
            _report(self, closed=True, event=event)
            if event["leave"]:
                # Left on screen: its final state is a line of the rank's output,
                # written in the same stream as the prints, so it lands in order.
                try:
                    sys.stdout.write(line(event) + "\n")
                    sys.stdout.flush()
                except Exception:
                    pass

    tqdm_cls.__init__, tqdm_cls.display, tqdm_cls.close = __init__, display, close
    tqdm_cls._accel_patched = True


def _plain_notebook(module) -> None:
    """``tqdm.notebook`` in a rank (there is no notebook there: it would print
    widget reprs) is the std bar, which reports as events."""
    import tqdm.std as std

    for name, value in (("tqdm", std.tqdm), ("trange", std.trange), ("tqdm_notebook", std.tqdm),
                        ("tnrange", std.trange)):
        setattr(module, name, value)


_AFTER_IMPORT = {"tqdm.std": lambda module: _patch(module.tqdm), "tqdm.notebook": _plain_notebook}


class _ImportHook:
    """Patches ``tqdm.std`` (and ``tqdm.notebook``) the moment they are imported
    (no post-import hooks in Python)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _AFTER_IMPORT or getattr(self, "_busy", False):
            return None
        import importlib.util

        self._busy = True     # stays in sys.meta_path: removing it races other threads' imports
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, _AFTER_IMPORT[fullname])
        return spec


class _PatchingLoader:
    """Wraps a module's loader (never changes the loader itself: a zip importer
    shares one between modules) to patch the module once it has run."""

    def __init__(self, loader, after) -> None:
        self.loader, self.after = loader, after

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        try:
            self.after(module)
        except Exception:
            pass

    def __getattr__(self, name):
        return getattr(self.loader, name)


def install(emit: Callable[[dict], bool]) -> None:
    """In a rank, before the cell runs: bars report through ``emit`` (the
    ``tqdm`` hook: the class is patched when tqdm is, or once it is, imported)."""
    global _emit, _owner
    if not hooks.install("tqdm", lambda: "bars become progress events"):
        return
    _emit, _owner = emit, os.getpid()
    std = sys.modules.get("tqdm.std")
    if std is not None and hasattr(std, "tqdm"):
        _patch(std.tqdm)
    if sys.modules.get("tqdm.notebook") is not None:
        _plain_notebook(sys.modules["tqdm.notebook"])
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())
