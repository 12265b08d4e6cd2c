"""A frontend that renders no widgets (issue 45, notebook hosts), in a real browser.

JupyterLab and Notebook 7 with ipywidgets' widget manager extension disabled
(as where it is not installed): a 2-rank cell still shows each rank's lines
live, as text, and its record when it ends.  With the extension (the control)
that text stays hidden behind the widget view.  Uses tests/test_browser.py's
hermetic server and page; screenshots go to its artifacts directory.
"""
from __future__ import annotations

import json
import time

import pytest

from test_browser import ARTIFACTS, CELL, Lab, _lab_page, _run_cell, _running, _wait_done, _wait_kernel, \
    _write_notebook

pytestmark = pytest.mark.timeout(300)

MANAGER = "@jupyter-widgets/jupyterlab-manager"
SLOW_CELL = (
    "%%distributed -n 2\n"
    "import os, time\n"
    "rank = os.environ['RANK']\n"
    "for step in range(8):\n"
    "    print(f'rank {rank} step {step}')\n"
    "    time.sleep(0.5)\n"
    "print(f'rank {rank} finished')\n"
)
NOTE = "this frontend shows no widgets"
# The outputs a user reads as text (not a widget's HTML), visible ones only.
SHOWN_TEXT_JS = """c => [...c.querySelectorAll('.jp-RenderedText')]
    .filter(e => e.offsetParent !== null && !e.closest('.lm-mod-hidden'))
    .map(e => e.innerText).join('\\n')"""
ROWS_JS = """c => [...c.querySelectorAll('.accel-magics-run .accel-magics-row')].map(e => e.innerText)"""


def _disable(lab: Lab, extension: str) -> None:
    """Disable ``extension`` in ``lab``'s page config (read at each page load)."""
    path = lab.tmp / "state" / "config" / "labconfig" / "page_config.json"
    config = json.loads(path.read_text())
    config["disabledExtensions"][extension] = True
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_without_the_widget_manager_each_rank_lines_show_live_as_text_then_the_record(app):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab(app)
    _disable(lab, MANAGER)
    _write_notebook(lab, "nowidgets.ipynb", ("%load_ext accel_magics", SLOW_CELL))
    with _lab_page(lab, {"width": 1200, "height": 900}, f"failure-nowidgets-{app}.png") as page:
        page.goto(lab.url("nowidgets.ipynb"))
        _wait_kernel(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        # Live: both ranks' lines as text while the cell still runs.
        deadline = time.monotonic() + 90
        while True:
            shown = cell.evaluate(SHOWN_TEXT_JS)
            if all(f"[rank {r}] rank {r} step 2" in shown for r in (0, 1)):
                break
            assert time.monotonic() < deadline, f"no live per-rank text: {shown!r}"
            time.sleep(0.1)
        assert _running(cell), "the lines came only after the cell ended"
        assert NOTE in shown, shown
        assert cell.locator(".accel-magics-run").count() == 0   # no widget rendered: the manager is off
        cell.screenshot(path=str(ARTIFACTS / f"nowidgets-{app}-1-live.png"))
        # The end: the record (HTML, no widget), and the live text gone.
        _wait_done(page, 1)
        summary = cell.locator(".accel-magics-summary")
        summary.wait_for()
        text = summary.inner_text()
        assert text.count("done") >= 2, text
        shown = cell.evaluate(SHOWN_TEXT_JS)
        assert NOTE not in shown and "step 2" not in shown, shown
        assert "rank 1 finished" in cell.locator(".jp-OutputArea").inner_text()
        cell.screenshot(path=str(ARTIFACTS / f"nowidgets-{app}-2-record.png"))


def test_with_the_widget_manager_the_text_beside_the_view_stays_hidden():
    """The control: the same cell where widgets render shows the view, and no
    text output of its lines beside it, while it runs and after."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    _write_notebook(lab, "widgets.ipynb", ("%load_ext accel_magics", SLOW_CELL))
    with _lab_page(lab, {"width": 1200, "height": 900}, "failure-widgets-control.png") as page:
        page.goto(lab.url("widgets.ipynb"))
        _wait_kernel(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        deadline = time.monotonic() + 90
        while not ((rows := cell.evaluate(ROWS_JS)) and len(rows) == 2 and all("step" in r for r in rows)):
            assert time.monotonic() < deadline, f"the view's rows show no steps: {rows}"
            time.sleep(0.1)
        assert _running(cell)
        shown = cell.evaluate(SHOWN_TEXT_JS)
        assert "step" not in shown and NOTE not in shown, shown
        cell.screenshot(path=str(ARTIFACTS / "nowidgets-control-1-live.png"))
        _wait_done(page, 1)
        cell.locator(".accel-magics-summary").wait_for()
        shown = cell.evaluate(SHOWN_TEXT_JS)
        assert "step" not in shown and NOTE not in shown, shown
        cell.screenshot(path=str(ARTIFACTS / "nowidgets-control-2-record.png"))
