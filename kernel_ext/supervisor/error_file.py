"""torch elastic's error files (``TORCHELASTIC_ERROR_FILE``), as torchrun's agent keeps them.

torchrun gives each rank the path of a file of its own
(``<run>/attempt_<n>/<local rank>/error.json``), in a folder it makes before
the ranks start.  ``torch.distributed.elastic.multiprocessing.errors.record``
writes there the exception that ends the decorated function (as JSON: its
``"Type: message"``, the formatted traceback and a timestamp); when the rank
fails, the agent reads it (``ProcessFailure``) and shows that exception as the
rank's failure instead of a bare exit code.  A run's supervisor does the same
here: it makes the folders (:func:`prepare`), reads a failed rank's file when
no exception of the rank reached the kernel (:func:`recorded`: a rank that
ended with ``os._exit`` or ``sys.exit(1)`` after ``@record`` saw its error),
and removes the run's folder as it ends (:func:`remove`; the launcher removes
a killed supervisor's).  The paths: ``environment.error_file``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional

from ..environment import make_dirs_below
from ..rank.worker import is_secondary

log = logging.getLogger("accel_magics.supervisor")

#: More than any @record file (a traceback): the rest is not read.
MAX_BYTES = 4 << 20
VARIABLE = "TORCHELASTIC_ERROR_FILE"


def prepare(spec: dict, ahead: Optional[str] = None) -> None:
    """Make the folder of each of this node's ranks' files (before they start).

    ``ahead``: folders an idle supervisor made for its next run
    (:func:`make_ahead`), taken by one rename where they fit; only the ones
    they lack are made here."""
    made = _take_ahead(spec, ahead) if ahead is not None else set()
    for env in spec.get("rank_env", ()):
        path = env.get(VARIABLE)
        if path and spec.get("error_dir") and os.path.dirname(path) not in made:
            # below the launcher's private directory, never that itself
            make_dirs_below(os.path.dirname(spec["error_dir"]), os.path.dirname(path))


def ahead_dir(private_dir: str, pid: int) -> str:
    """Where the idle supervisor ``pid`` keeps its next run's folders (see :func:`make_ahead`)."""
    return os.path.join(private_dir, f"errors-ahead-{pid}")


def make_ahead(private_dir: str, ranks: int) -> Optional[str]:
    """In an idle supervisor: its next run's folders of error files
    (``attempt_0/<local rank>`` for ``ranks`` ranks) under a name of its own,
    so that the run's start renames one folder instead of making one per
    rank and level.  None where they could not be made (the run makes its own)."""
    if not private_dir:
        return None
    folder = ahead_dir(private_dir, os.getpid())
    for local_rank in range(ranks):
        if not make_dirs_below(private_dir, os.path.join(folder, "attempt_0", str(local_rank))):
            remove_ahead(folder)
            return None
    return folder


def remove_ahead(folder: Optional[str]) -> None:
    """The folders :func:`make_ahead` made, no run took them (the spare was dropped)."""
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _take_ahead(spec: dict, ahead: str) -> set[str]:
    """``ahead`` renamed to the run's folder when both are in the same
    directory: the rank folders that now exist (none if not taken; then
    ``ahead`` is removed)."""
    folder = spec.get("error_dir")
    if not folder or os.path.dirname(folder) != os.path.dirname(ahead):
        remove_ahead(ahead)
        return set()
    try:
        ranks = os.listdir(os.path.join(ahead, "attempt_0"))
        os.rename(ahead, folder)
    except OSError:
        remove_ahead(ahead)
        return set()
    return {os.path.join(folder, "attempt_0", rank) for rank in ranks}


def remove(spec: dict) -> None:
    """Remove the run's folder of error files (the run is over)."""
    folder = spec.get("error_dir")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def path_of(spec: dict, local_rank: int) -> Optional[str]:
    envs = spec.get("rank_env") or ()
    return envs[local_rank].get(VARIABLE) if local_rank < len(envs) else None


def recorded(path: Optional[str]) -> Optional[dict]:
    """What ``@record`` wrote to ``path``, as a failure: ``exc_type``,
    ``message``, ``traceback``, ``timestamp`` (when it was written: the
    file's mtime, finer than the second torch writes) and ``secondary``;
    None when there is no such file.  A file that is not ``@record``'s JSON
    is taken as text (torchrun would fail on it)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            written = os.fstat(f.fileno()).st_mtime
            raw = f.read(MAX_BYTES)
    except OSError:   # no file: nothing was recorded
        return None
    text = raw.decode("utf-8", "replace")
    traceback = ""
    try:
        data = json.loads(text)
        message = data["message"]
        if isinstance(message, dict):   # {"message": {"message": ..., "extraInfo": {"py_callstack": ...}}}
            traceback = str((message.get("extraInfo") or {}).get("py_callstack") or "")
            message = message.get("message", "")
        message = str(message)
    except (ValueError, KeyError, TypeError, AttributeError):
        log.info("the error file %s is not what @record writes; taken as text", path)
        message = text.strip()
    exc_type, _, rest = message.partition(": ")
    return {"exc_type": exc_type, "message": rest, "traceback": traceback, "timestamp": written,
            "secondary": is_secondary(exc_type, rest)}
