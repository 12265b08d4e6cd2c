"""The launch-config form: every launch option the options table labels.

Each field is validated and applied on its own: a valid change becomes the
default of later ``%%distributed`` cells at once (flags in a cell still win);
an invalid one is marked beside its field, says why, and is not applied,
while the other fields keep working.  Nothing is coerced: ``-1`` stays
``-1`` and is refused, and "default" is spelled out (an empty port or
timeout means the built-in default, never ``0``).  A field refused only
because of another (``node_rank`` 1 of 1 node) is tried again when that
other changes.

There is one form per kernel: every ``%distributed_config`` shows the same
widget models, so two forms on a page stay in sync.  The rules and the
command line come from the caller (``check``, ``describe``); the fields,
their labels and choices from the options table (``kernel_ext/options.py``),
so this module imports ipywidgets and that table only.
"""
from __future__ import annotations

import html
from typing import Callable, Optional

import ipywidgets as w

from accel_magics.kernel_ext.options import BY_NAME, OPTIONS

# The fields, their labels and choices: the options table's (kernel_ext/options.py).
MIXED = [("Accelerate's default", "default")] + [(c, c) for c in BY_NAME["mixed_precision"].choices]
_UNREADABLE = object()   # a field whose text is not a value: never applied until edited
LABELS = {option.name: option.label for option in OPTIONS if option.label}
INT_FIELDS = tuple(name for name in LABELS if BY_NAME[name].type is int and name != "master_port")
#: Fields whose empty text means "the built-in default" (or none): a number of seconds, a path, a port.
SECONDS_FIELDS = tuple(name for name in LABELS if BY_NAME[name].type is float)
TEXT_FIELDS = ("master_port", *SECONDS_FIELDS, "config_file")
FLAG_FIELDS = tuple(name for name in LABELS if BY_NAME[name].is_flag)


def _placeholder(name: str) -> str:
    """What an empty field means, short enough to be read whole in the field."""
    option = BY_NAME[name]
    if name == "master_port":
        return "default: a free port"
    if option.default is None:
        return "none"
    return f"default: {option.default:g}" if isinstance(option.default, float) else f"default: {option.default}"


class ConfigForm:
    def __init__(self, values: dict, check: Callable[[dict], str], apply: Callable[[dict], None],
                 describe: Callable[[dict], str], info: str = "") -> None:
        self.check, self.apply, self.describe = check, apply, describe
        self.applied = dict(values)
        self.pending: dict = {}        # field -> (value, why it was refused)
        self._syncing = False
        style = {"description_width": "150px"}   # every label read whole ("rendezvous timeout (s)")
        self.fields = {name: w.IntText(description=LABELS[name], style=style) for name in INT_FIELDS}
        self.fields["master_addr"] = w.Text(description=LABELS["master_addr"], continuous_update=False, style=style)
        for name in TEXT_FIELDS:
            self.fields[name] = w.Text(description=LABELS[name], continuous_update=False, style=style,
                                       placeholder=_placeholder(name), tooltip=BY_NAME[name].help_text())
        self.fields["mixed_precision"] = w.Dropdown(options=MIXED, description=LABELS["mixed_precision"], style=style)
        self.fields["output"] = w.Dropdown(options=list(BY_NAME["output"].choices), description=LABELS["output"],
                                           style=style)
        # The placements: local, slurm and the installed plug-ins (kernel_ext/kernel/placement.py).
        self.fields["launcher"] = w.Dropdown(options=list(BY_NAME["launcher"].choice_names()),
                                             description=LABELS["launcher"], style=style)
        for name in FLAG_FIELDS:   # given or not: a box (its help in the tooltip)
            self.fields[name] = w.Checkbox(description=LABELS[name], indent=True, style=style,
                                           tooltip=BY_NAME[name].help_text())
        self.notes = {name: w.HTML() for name in self.fields}
        self.status = w.HTML()
        self.command = w.HTML()
        rows = [w.HBox([self.fields[name], self.notes[name]]) for name in self.fields]
        head = [w.HTML("<b>%%distributed defaults</b> (each field applies on its own)")]
        if info:   # the Slurm allocation this kernel runs in, and its nodes
            head.append(w.HTML(f"<span style='color:var(--jp-ui-font-color2,#666)'>{html.escape(info)}</span>"))
        self.widget = w.VBox([*head, *rows, self.status, self.command])
        self.widget.add_class("accel-magics-config")
        self.on_applied: Optional[Callable[[], None]] = None
        self.sync(values)
        for name, field in self.fields.items():
            field.observe(lambda change, name=name: self._changed(name), names="value")

    # -- values ---------------------------------------------------------------
    def sync(self, values: dict) -> None:
        """Show ``values`` (the defaults applied now, however they were set)."""
        self._syncing = True
        try:
            self.applied = dict(values)
            self.pending.clear()
            for name, field in self.fields.items():
                value = values.get(name)
                if name in TEXT_FIELDS:
                    field.value = "" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))
                elif name in INT_FIELDS:
                    field.value = int(value or 0)
                elif name == "mixed_precision":
                    field.value = value or "default"
                elif name in FLAG_FIELDS:
                    field.value = bool(value)
                elif value is not None:
                    field.value = value
                self.notes[name].value = ""
        finally:
            self._syncing = False
        self._show_status()

    def _parse(self, name: str):
        raw = self.fields[name].value
        if name == "master_port":
            text = str(raw).strip()
            if text in ("", "default"):
                return None
            if not text.isdigit():
                raise ValueError("a port number (1-65535), or empty for the default")
            return int(text)
        if name in SECONDS_FIELDS:
            text = str(raw).strip()
            if text in ("", "none", "default"):
                return None
            try:
                return float(text)
            except ValueError:
                empty = "no timeout" if BY_NAME[name].default is None else "the default"
                raise ValueError(f"a number of seconds, or empty for {empty}") from None
        if name == "config_file":
            return str(raw).strip() or None
        if name == "master_addr":
            return str(raw).strip()
        if name == "mixed_precision":
            return None if raw == "default" else raw
        return raw

    # -- changes ----------------------------------------------------------------
    def _changed(self, name: str) -> None:
        if self._syncing:
            return
        try:
            value = self._parse(name)
        except ValueError as exc:
            self._refuse(name, _UNREADABLE, str(exc))
            self._show_status()
            return
        self._try(name, value)
        # A field refused because of another may be fine now.
        for other, (pending_value, _) in list(self.pending.items()):
            if other != name and pending_value is not _UNREADABLE:
                self._try(other, pending_value)
        self._show_status()

    def _try(self, name: str, value) -> bool:
        candidate = {**self.applied, name: value}
        problem = self.check(candidate)
        if problem:
            self._refuse(name, value, problem)
            return False
        self.applied = candidate
        self.pending.pop(name, None)
        self.notes[name].value = ""
        self.apply(candidate)
        if self.on_applied is not None:
            self.on_applied()
        return True

    def _refuse(self, name: str, value, why: str) -> None:
        self.pending[name] = (value, why)
        self.notes[name].value = f"<span style='color:#d62728'>&#10007; not applied: {html.escape(why, quote=False)}</span>"

    def _show_status(self) -> None:
        # The line, then (several nodes) the line each other node runs: one a row.
        self.command.value = "<br>".join(f"<code>{html.escape(line)}</code>"
                                         for line in self.describe(self.applied).splitlines())
        if self.pending:
            names = ", ".join(LABELS[n] for n in self.pending)
            self.status.value = (f"<span style='color:#d62728'>&#10007; not applied: {html.escape(names, quote=False)} "
                                 "(see beside the field); the other fields are applied</span>")
        else:
            self.status.value = ("<span style='color:#2ca02c'>&#10003; applied: later %%distributed cells use "
                                 "these</span>")
