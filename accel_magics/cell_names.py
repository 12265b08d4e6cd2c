"""How the notebook names a cell's code: ``In[2]``, ``Cell In[2]``, and where
a GPU runtime was initialised in the kernel (the pre-flight check's words),
as IPython's own tracebacks name them."""
from __future__ import annotations

from typing import Optional

from accel_magics.kernel_ext.kernel import preflight


class CellNames:
    """The names of the cells of ``shell`` (an IPython shell)."""

    def __init__(self, shell) -> None:
        self.shell = shell

    def code_name(self, filename: str) -> Optional[tuple]:
        """``("Cell", "In[2]")`` for code compiled from a notebook cell, as
        IPython's tracebacks name it; None for code from a file."""
        compiler = self.shell.compile
        if hasattr(compiler, "format_code_name"):   # IPython >= 8
            return compiler.format_code_name(filename) if filename in compiler._filename_map else None
        # IPython 7 (Kaggle's and Colab's images) keeps no map, but each cell's source, under
        # the name it was compiled as: the latest cell of the history with that source.
        import linecache

        entry = getattr(linecache, "_ipython_cache", {}).get(filename)
        if entry is None:
            return None
        source, parsed = "".join(entry[2]).rstrip("\n"), self.shell.history_manager.input_hist_parsed
        number = next((n for n in range(len(parsed) - 1, 0, -1) if parsed[n].rstrip("\n") == source), None)
        return ("Cell", f"In[{number}]") if number is not None else None

    def is_cell_file(self, filename: str) -> bool:
        return self.code_name(filename) is not None

    def cell_label(self, filename: str) -> Optional[str]:
        """``Cell In[2]`` for code compiled from a notebook cell, as IPython's
        tracebacks name it; None for code from a file."""
        label = self.code_name(filename)
        return f"{label[0]} {label[1]}" if label else None

    def describe_site(self, site: preflight.InitSite) -> str:
        """Where a GPU runtime was initialised: ``at In[3], line 2: torch.cuda.init()``."""
        if site.frames:
            frame = site.frames[-1]
            label = self.code_name(frame.filename)
            where = label[1] if label else frame.filename
            code = f": {frame.line.strip()}" if frame.line else ""
            return f"at {where}, line {frame.lineno}{code}"
        if site.cell_label:
            return f"in cell {site.cell_label}"
        return ""

    def cell_number(self) -> int:
        """N of the running cell's In[N] prompt.

        IPython 9 advances ``execution_count`` before running a cell, earlier
        versions after; both store the cell's input first, as In[N].
        """
        count = self.shell.execution_count
        stored = len(self.shell.history_manager.input_hist_parsed) - 1
        return min(count, stored) if stored > 0 else count
