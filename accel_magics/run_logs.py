"""Where a run's full log goes: ``<log root>/<time>-In<N>-<random>/rank<N>.log``.

The views keep only a rank's first and last lines; its complete output is
written, by the run's supervisor, to a file per rank in the run's directory
(``kernel_ext.supervisor.rank_logs``), whose path the views show.  The log root is
``$ACCEL_MAGICS_LOG_DIR``, else ``$XDG_CACHE_HOME/accel_magics/runs``
(``~/.cache/accel_magics/runs``); only the newest runs are kept.
"""
from __future__ import annotations

import os
import time

from .kernel_ext.wire import new_id


def log_root() -> str:
    root = os.environ.get("ACCEL_MAGICS_LOG_DIR")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(cache, "accel_magics", "runs")
    return root


def run_log_dir(label: str) -> str:
    """The directory for a run started now (made at its first line: quiet runs
    leave none).  The random part keeps two kernels' runs of the same second
    and cell number apart."""
    return os.path.join(log_root(), time.strftime("%Y%m%d-%H%M%S-") + label + "-" + new_id(8))
