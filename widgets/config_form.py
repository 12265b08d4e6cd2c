"""The launch-config form: processes, nodes, node_rank, master address and port.

Validated as you type; the equivalent ``%%distributed`` command line is shown
under it; every valid change becomes the default of later ``%%distributed``
cells (flags in a cell still win).  Invalid values are shown in red and not
applied.  The rules and the command line come from the caller (``check``,
``describe``), so this module imports ipywidgets only.
"""
from __future__ import annotations

import html
from typing import Callable

import ipywidgets as w

MIXED = ["(none)", "no", "fp16", "bf16", "fp8"]


class ConfigForm:
    def __init__(self, values: dict, check: Callable[[dict], str], apply: Callable[[dict], None],
                 describe: Callable[[dict], str]) -> None:
        self.check, self.apply, self.describe = check, apply, describe
        style = {"description_width": "130px"}
        self.fields = {
            "num_processes": w.BoundedIntText(value=values["num_processes"], min=1, max=4096,
                                              description="processes / node", style=style),
            "num_nodes": w.BoundedIntText(value=values["num_nodes"], min=1, max=4096,
                                          description="nodes", style=style),
            "node_rank": w.BoundedIntText(value=values["node_rank"], min=0, max=4095,
                                          description="this node's rank", style=style),
            "master_addr": w.Text(value=values["master_addr"], description="master address",
                                  continuous_update=False, style=style),
            "master_port": w.BoundedIntText(value=values["master_port"] or 0, min=0, max=65535,
                                            description="master port", style=style),
            "max_restarts": w.BoundedIntText(value=values["max_restarts"], min=0, max=100,
                                             description="max restarts", style=style),
            "mixed_precision": w.Dropdown(options=MIXED, value=values["mixed_precision"] or "(none)",
                                          description="mixed precision", style=style),
            "timeout": w.BoundedFloatText(value=values["timeout"] or 0, min=0, max=1e7,
                                          description="timeout (s)", style=style),
            "output": w.Dropdown(options=["auto", "widget", "text"], value=values["output"],
                                 description="output", style=style),
        }
        self.fields["master_port"].tooltip = "0: a fresh free port per run (29500 for multi-node)"
        self.fields["timeout"].tooltip = "0: no timeout"
        self.status = w.HTML()
        self.command = w.HTML()
        self.widget = w.VBox([w.HTML("<b>%%distributed defaults</b>"), *self.fields.values(),
                              self.status, self.command])
        self.widget.add_class("accel-magics-config")
        for field in self.fields.values():
            field.observe(self._changed, names="value")
        self._changed()

    def values(self) -> dict:
        v = {name: field.value for name, field in self.fields.items()}
        v["master_port"] = v["master_port"] or None
        v["timeout"] = v["timeout"] or None
        v["mixed_precision"] = None if v["mixed_precision"] == "(none)" else v["mixed_precision"]
        return v

    def _changed(self, change=None) -> None:
        values = self.values()
        problem = self.check(values)
        self.command.value = f"<code>{html.escape(self.describe(values))}</code>"
        if problem:
            self.status.value = f"<span style='color:#d62728'>&#10007; {html.escape(problem)} (not applied)</span>"
            return
        self.apply(values)
        self.status.value = "<span style='color:#2ca02c'>&#10003; applied: later %%distributed cells use these</span>"
