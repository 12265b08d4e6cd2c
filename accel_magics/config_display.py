"""The config form of ``%distributed_config`` (no arguments, in a notebook):
one per kernel, shown wherever it is asked for, its text the applied defaults."""
from __future__ import annotations

from typing import Callable

from accel_magics.kernel_ext.kernel.slurm import describe_allocation

from .defaults import LaunchDefaults


class ConfigFormDisplays:
    """The kernel's one form (every %distributed_config shows the same models,
    so forms on a page stay in sync) and where it is shown, each with the
    applied defaults as its text: what a saved or exported notebook shows."""

    def __init__(self, defaults: LaunchDefaults, summary: Callable[[dict], str],
                 describe: Callable[[dict], str]) -> None:
        self.defaults = defaults
        self.summary = summary     # the defaults as text (magics.config_summary)
        self.describe = describe   # the command line of each node (magics.describe_nodes)
        self.form = None
        self.displays: list = []

    def show(self) -> None:
        from IPython.display import display
        from accel_magics.widgets.config_form import ConfigForm

        self.defaults.ensure_known()
        if self.form is None:
            self.form = ConfigForm(self.defaults.effective(), check=self.defaults.check, apply=self.defaults.apply_form,
                                   describe=self.describe, info=describe_allocation())
            self.form.on_applied = self._update_texts
        else:
            self.form.sync(self.defaults.effective())
        self.displays.append(display(self._bundle(), raw=True, display_id=True))

    def follow(self) -> None:
        """Defaults set by the line magic: a form already shown shows them."""
        if self.form is not None:
            self.form.sync(self.defaults.effective())
            self._update_texts()

    def _bundle(self) -> dict:
        return {"application/vnd.jupyter.widget-view+json": {
                    "version_major": 2, "version_minor": 0, "model_id": self.form.widget.model_id},
                "text/plain": self.summary(self.defaults.effective())}

    def _update_texts(self) -> None:
        for handle in self.displays:
            handle.update(self._bundle(), raw=True)
