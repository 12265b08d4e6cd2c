"""A person's view: JupyterLab in headless Chromium, driven by Playwright.

Opens a notebook in a real JupyterLab (hermetic: its own config, data and
runtime directories, loopback only, no network plugins), runs a 2-rank cell
with a tqdm loop and checks what a user sees: the progress view renders, its
bars advance and reach 100%, each rank's pane shows that rank's lines, the
record replaces the view at the end; then the config form renders and a
change in it changes the next run.  Screenshots go to
``tests/artifacts/browser/`` (or ``$ACCEL_MAGICS_ARTIFACTS``).

Needs Debian's Chromium (``/usr/bin/chromium``) and the ``browser`` extra
(jupyterlab, playwright); Playwright never downloads a browser here.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
playwright_api = pytest.importorskip("playwright.sync_api", reason="the browser extra (playwright) is not installed")
psutil = pytest.importorskip("psutil")
pytest.importorskip("jupyterlab", reason="the browser extra (jupyterlab) is not installed")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

ARTIFACTS = Path(os.environ.get("ACCEL_MAGICS_ARTIFACTS",
                                Path(__file__).resolve().parent / "artifacts" / "browser"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--no-default-browser-check", "--disable-crash-reporter",
                 "--disable-breakpad"]
CELL = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell.jp-CodeCell"
KERNEL_IDLE_JS = """() => {
    const i = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator');
    const s = document.querySelector('#jp-main-statusbar .jp-StatusBar-TextItem[title^="Change kernel for"]');
    return !!(i && s && i.dataset.status === 'idle' && /\\| Idle$/.test(s.textContent.trim())
              && !s.textContent.startsWith('No Kernel'));
}"""
BAR_WIDTHS_JS = """c => [...c.querySelectorAll('.accel-magics-run .accel-magics-row')]
                      .map(r => r.querySelector('.accel-magics-fill'))
                      .map(e => e ? parseFloat(e.style.width || '0') : 0)"""

TRAIN_CELL = (
    "%%distributed -n 2\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "rank = os.environ['RANK']\n"
    "print(f'rank {rank} starting')\n"
    "for step in tqdm(range(40), desc='train'):\n"
    "    time.sleep(0.1)\n"
    "print(f'rank {rank} saving a checkpoint')\n"
    "time.sleep(2.5)\n"
    "print(f'rank {rank} finished')\n"
)
CELLS = ["%load_ext accel_magics", TRAIN_CELL, "%distributed_config",
         "%%distributed --output text\nimport os\nprint('world size', os.environ['WORLD_SIZE'])"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, token: str, path: str):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


class Lab:
    """A hermetic JupyterLab server on loopback, stopped with everything it started."""

    def __init__(self, app: str = "jupyterlab") -> None:
        self.app = app   # "jupyterlab", or "notebook" (Notebook 7)
        self.tmp = Path(tempfile.mkdtemp(prefix="accel-lab-"))
        self.root, state = self.tmp / "root", self.tmp / "state"
        self.root.mkdir()
        (state / "config" / "labconfig").mkdir(parents=True)
        (state / "config" / "labconfig" / "page_config.json").write_text(json.dumps({"disabledExtensions": {
            "@jupyterlab/apputils-extension:announcements": True,
            "@jupyterlab/extensionmanager-extension": True}}))
        (state / "config" / "jupyter_server_config.json").write_text(json.dumps({"LabApp": {
            "news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
            "extension_manager": "readonly"}}))
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, self.root / "run.ipynb")
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_DATA_DIR=str(state / "data"),
                   JUPYTER_RUNTIME_DIR=str(state / "runtime"), IPYTHONDIR=str(state / "ipython"),
                   JUPYTER_PLATFORM_DIRS="1", ACCEL_MAGICS_LOG_DIR=str(state / "runs"), PYTHONUNBUFFERED="1")
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.log = open(state / "lab.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", app, "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.tracked: set[int] = set()
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, "jupyter lab exited at start"
            try:
                _get(self.port, self.token, "/api/status")
                return
            except OSError:
                assert time.monotonic() < deadline, "jupyter lab did not answer"
                time.sleep(0.25)

    def url(self, name: str) -> str:
        where = "lab/tree" if self.app == "jupyterlab" else "notebooks"
        return f"http://127.0.0.1:{self.port}/{where}/{name}?token={self.token}"

    def kernel_idle(self) -> bool:
        kernels = _get(self.port, self.token, "/api/kernels")
        return bool(kernels) and all(k["execution_state"] == "idle" and k["connections"] >= 1 for k in kernels)

    def track(self) -> None:
        try:
            self.tracked |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> list[int]:
        """SIGTERM the server (it shuts its kernels down); then nothing it started may remain."""
        self.track()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        deadline = time.monotonic() + 15
        while True:
            alive = [pid for pid in self.tracked if psutil.pid_exists(pid)
                     and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in alive:
            psutil.Process(pid).kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return alive


def _wait_idle(page, lab: Lab) -> None:
    page.wait_for_function(KERNEL_IDLE_JS)
    deadline = time.monotonic() + 60
    while not lab.kernel_idle():
        assert time.monotonic() < deadline, "the kernel did not become idle"
        time.sleep(0.2)


def _run_cell(page, index: int) -> None:
    cell = page.locator(CELL).nth(index)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def _wait_done(page, index: int) -> None:
    page.wait_for_function(
        """([sel, i]) => /\\[\\d+\\]/.test(document.querySelectorAll(sel + ' .jp-InputArea-prompt')[i].textContent)""",
        arg=[CELL, index])


@contextlib.contextmanager
def _lab_page(lab: "Lab", viewport: dict, failure_png: str):
    """A Chromium page on ``lab``; a screenshot named ``failure_png`` if the
    block fails; the browser closed, then the server stopped, and nothing it
    started may remain."""
    try:
        with playwright_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            page = None
            try:
                page = browser.new_page(viewport=viewport)
                page.set_default_timeout(120_000)
                yield page
                lab.track()
            except Exception:
                try:
                    if page is not None:
                        page.screenshot(path=str(ARTIFACTS / failure_png), full_page=True)
                finally:
                    raise
            finally:
                browser.close()
    finally:
        leftovers = lab.stop()
    assert not leftovers, f"processes left after JupyterLab stopped: {leftovers}"


def test_progress_view_and_config_form_in_jupyterlab():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    with _lab_page(lab, {"width": 1400, "height": 1100}, "failure.png") as page:
        page.goto(lab.url("run.ipynb"))
        _wait_idle(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)

        # The progress view: bars advance while the ranks train...
        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        cell.locator(".accel-magics-run .accel-magics-row").nth(1).wait_for()
        seen: list[list[float]] = []
        deadline = time.monotonic() + 60
        while not (seen and len(seen[-1]) == 2 and min(seen[-1]) >= 100):
            assert time.monotonic() < deadline, f"the bars did not reach 100%: {seen[-5:]}"
            seen.append(cell.evaluate(BAR_WIDTHS_JS))
            if len(seen) == 8:
                cell.screenshot(path=str(ARTIFACTS / "1-progress-advancing.png"))
            time.sleep(0.1)
        for rank in (0, 1):
            values = sorted({s[rank] for s in seen if len(s) == 2})
            assert len([v for v in values if 0 < v < 100]) >= 2, values   # it advanced
        # the rows show tqdm's final state; the panes hold only what the ranks printed
        cell.locator(".accel-magics-run .accel-magics-bartext", has_text="train: 100%").first.wait_for()
        cell.screenshot(path=str(ARTIFACTS / "2-progress-100.png"))
        # ...and each rank's pane shows that rank's lines (while it saves its checkpoint).
        for rank, other in ((1, 0), (0, 1)):
            cell.locator(".accel-magics-run .lm-TabBar-tab", has_text=f"rank {rank}").click()
            pane = cell.locator(".accel-magics-run .widget-tab-contents .widget-html:visible").first
            pane.filter(has_text=f"rank {rank} saving a checkpoint").wait_for()
            assert f"rank {other}" not in pane.inner_text()
            cell.screenshot(path=str(ARTIFACTS / f"3-rank-{rank}-pane.png"))
        # At the end the live view gives way to the record: final states, 100%, per-rank output.
        _wait_done(page, 1)
        summary = cell.locator(".accel-magics-summary")
        summary.wait_for()
        text = summary.inner_text()
        assert text.count("done") >= 2 and text.count("100%") >= 2, text
        assert cell.locator(".accel-magics-run").count() == 0
        cell.screenshot(path=str(ARTIFACTS / "4-record.png"))

        # The config form: a change in it changes the next run.
        _run_cell(page, 2)
        form = page.locator(CELL).nth(2).locator(".accel-magics-config")
        form.wait_for()
        box = form.locator(".widget-inline-hbox", has_text="processes / node").locator("input")
        box.fill("3")
        box.press("Enter")
        form.locator("code", has_text="--num_processes 3").wait_for()
        page.locator(CELL).nth(2).screenshot(path=str(ARTIFACTS / "5-config-form.png"))
        _run_cell(page, 3)
        _wait_done(page, 3)
        out = page.locator(CELL).nth(3).locator(".jp-OutputArea").inner_text()
        assert "[rank 2] world size 3" in out, out
        page.screenshot(path=str(ARTIFACTS / "6-notebook.png"), full_page=True)


NESTED_CELL = (
    "%%distributed -n 4\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "rank = os.environ['RANK']\n"
    "for epoch in tqdm(range(3), desc='epoch'):\n"
    "    for step in tqdm(range(40), desc='step', leave=False):\n"
    "        time.sleep(0.05)\n"
    "        if step == 20:\n"
    "            print(f'rank {rank} epoch {epoch} half way, loss {0.5 / (epoch + 1):.3f}')\n"
    "    print(f'rank {rank} epoch {epoch} done')\n"
)
TAIL_CELL = (
    "%%distributed -n 2\n"
    "import time\n"
    "for i in range(300):\n"
    "    print('line', i)\n"
    "    time.sleep(0.01)\n"
    "time.sleep(2)\n"
)
PANE_BOTTOM_JS = """c => { const p = [...c.querySelectorAll('.accel-magics-run .accel-magics-pane')]
    .find(e => e.offsetParent !== null);
    if (!p) return null;
    const last = p.querySelector('pre');
    const pr = p.getBoundingClientRect(), lr = last.getBoundingClientRect();
    return {paneBottom: pr.bottom, lastBottom: lr.bottom, text: p.innerText.trim().split('\\n').pop()}; }"""


def test_nested_bars_narrow_window_follow_the_tail_and_dark_theme():
    """Issue 13 in a real browser: nested tqdm bars (4 ranks, inner leave=False,
    prints inside) in a 1000 px window with the file browser open; panes follow
    the output; the kept record in the dark theme."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in
                                         ("%load_ext accel_magics", NESTED_CELL, TAIL_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "view.ipynb")
    with _lab_page(lab, {"width": 1000, "height": 1000}, "failure-view.png") as page:
        page.goto(lab.url("view.ipynb"))
        _wait_idle(page, lab)
        page.locator(".jp-DirListing").first.wait_for()   # the file browser is open
        _run_cell(page, 0)
        _wait_done(page, 0)

        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        row = cell.locator(".accel-magics-run .accel-magics-row").nth(3)
        row.wait_for()
        # Two nested bars on a row while an epoch runs (the inner one goes when done).
        page.wait_for_function("""c => [...c.querySelectorAll('.accel-magics-run .accel-magics-row')]
            .some(r => r.querySelectorAll('.accel-magics-bar').length == 2)""", arg=cell.element_handle())
        cell.screenshot(path=str(ARTIFACTS / "7-nested-bars-1000px.png"))
        # The tabs stay inside the window, each row on at most a few lines.
        boxes = cell.evaluate("""c => [...c.querySelectorAll(
            '.accel-magics-run .lm-TabBar, .accel-magics-run .accel-magics-row')].map(e => {
            const r = e.getBoundingClientRect(); return [e.className, r.right, r.height]; })""")
        assert len(boxes) == 5, boxes
        for name, right, height in boxes:
            assert right <= 1000 and ("TabBar" in name or height < 80), boxes
        # The row's latest line is the latest print, not the bar text.
        page.wait_for_function("""c => { const e = c.querySelector('.accel-magics-run .accel-magics-latest');
            return !!e && /epoch \\d (half way|done)/.test(e.textContent); }""", arg=cell.element_handle())
        _wait_done(page, 1)
        summary = cell.locator(".accel-magics-summary")
        summary.wait_for()
        text = summary.inner_text()
        assert "\x1b" not in text and "step:" not in text, text
        # Each rank's row keeps its finished outer bar, and its output ends with the
        # bar's final line (as a terminal keeps it): 6 prints + 1 bar line.
        assert text.count("epoch: 100% 3/3") == 4 and text.count("epoch: 100%|██████████| 3/3") == 4, text
        assert "rank 0 epoch 2 done" in text and "(7 lines)" in text, text
        cell.screenshot(path=str(ARTIFACTS / "8-nested-record.png"))

        _run_cell(page, 2)
        cell = page.locator(CELL).nth(2)
        cell.locator(".accel-magics-run .accel-magics-pane pre").first.wait_for()
        page.wait_for_function("c => /line 2\\d\\d/.test(c.innerText)", arg=cell.element_handle())
        seen = cell.evaluate(PANE_BOTTOM_JS)
        assert seen and seen["text"].startswith("[rank") and abs(seen["lastBottom"] - seen["paneBottom"]) < 30, seen
        cell.screenshot(path=str(ARTIFACTS / "9-pane-follows-the-tail.png"))
        _wait_done(page, 2)

        # Dark theme: the kept records stay readable (bar tracks from the theme).
        page.keyboard.press("Control+Shift+C")
        page.keyboard.type("JupyterLab Dark")
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
        time.sleep(1)
        page.locator(CELL).nth(1).screenshot(path=str(ARTIFACTS / "10-dark-record.png"))
        track = page.locator(CELL).nth(1).locator(".accel-magics-summary .accel-magics-track").first
        color = track.evaluate("e => getComputedStyle(e).backgroundColor")
        assert color not in ("rgb(238, 238, 238)", "rgb(255, 255, 255)"), color


BACKGROUND_CELL = (
    "%%distributed --session --background\n"
    "import time\n"
    "from tqdm.auto import tqdm\n"
    "for step in tqdm(range(60), desc='background'):\n"
    "    time.sleep(0.1)\n"
    "print('trained in the background')\n"
)


def test_a_background_session_cell_keeps_its_view_live_while_other_cells_run():
    """Issue 15 in a real browser: a background cell's live view keeps updating
    while another cell runs, and is replaced by its record (in its own cell)
    when the run ends."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    cells = ("%load_ext accel_magics", "%distributed_session start -n 2", BACKGROUND_CELL,
             "import time\nfor i in range(3):\n    print('meanwhile', i)\n    time.sleep(1)",
             "h = Out[3] if 3 in Out else _\nh.wait()\nprint(h.status)", "%distributed_session stop")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / "background.ipynb")
    with _lab_page(lab, {"width": 1300, "height": 1200}, "failure-background.png") as page:
        page.goto(lab.url("background.ipynb"))
        _wait_idle(page, lab)
        for i in (0, 1):
            _run_cell(page, i)
            _wait_done(page, i)
        _run_cell(page, 2)
        _wait_done(page, 2)                      # returned at once: a handle
        bg = page.locator(CELL).nth(2)
        assert "background run In[" in bg.locator(".jp-OutputArea").inner_text()
        bg.locator(".accel-magics-run .accel-magics-row").nth(1).wait_for()
        _run_cell(page, 3)                       # another cell runs meanwhile...
        widths = []
        while len(widths) < 20:
            widths.append(max(bg.evaluate(BAR_WIDTHS_JS) or [0]))
            time.sleep(0.1)
        assert len(set(widths)) >= 3 and 0 < max(widths) < 100, widths   # ...and the view keeps moving
        bg.screenshot(path=str(ARTIFACTS / "11-background-live.png"))
        _wait_done(page, 3)
        out3 = page.locator(CELL).nth(3).locator(".jp-OutputArea").inner_text()
        assert "meanwhile 2" in out3 and "[rank" not in out3, out3    # its output stayed in its own cell
        _run_cell(page, 4)
        _wait_done(page, 4)
        assert "done" in page.locator(CELL).nth(4).locator(".jp-OutputArea").inner_text()
        summary = bg.locator(".accel-magics-summary")
        summary.wait_for()                       # the record replaced the live view, in the cell that ran it
        text = summary.inner_text()
        assert "trained in the background" in text and text.count("100%") >= 2, text
        assert bg.locator(".accel-magics-run").count() == 0
        bg.screenshot(path=str(ARTIFACTS / "12-background-record.png"))
        _run_cell(page, 5)
        _wait_done(page, 5)


RECORD_CELL = (
    "%%distributed -n 2 --output widget\n"
    "import os\n"
    "from tqdm.auto import tqdm\n"
    "for epoch in tqdm(range(3), desc='epoch'):\n"
    "    for step in tqdm(range(5), desc='step', leave=False):\n"
    "        pass\n"
    "    print(f\"rank {os.environ['RANK']} epoch {epoch} loss 0.{3 - epoch}\")\n"
    "partial = tqdm(total=4, desc='eval', mininterval=0)\n"
    "partial.update(3)\n"
    "partial.refresh()\n"
)
# Proof that the reopened notebook is untrusted: the sanitizer drops this <style>.
SENTINEL = "<style>.accel-sentinel{color:red}</style><div class='accel-sentinel'>sentinel</div>"
RECORD_JS = """c => {
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; };
    const s = c.querySelector('.accel-magics-summary');
    if (!s) return null;
    return {rows: [...s.querySelectorAll('.accel-magics-row')].map(r => ({
                row: box(r), parts: [...r.children].map(box),
                fills: [...r.querySelectorAll('.accel-magics-track')].map(t => {
                    const f = t.querySelector('.accel-magics-fill');
                    return [box(t)[2], f ? box(f)[2] : -1, f ? box(f)[3] : -1]; })})),
            pre: getComputedStyle(s.querySelector('pre')).fontFamily,
            track: getComputedStyle(s.querySelector('.accel-magics-track')).backgroundColor};
}"""


def _record_notebook(path: Path) -> None:
    """A notebook with a real run's record (a real kernel, real ranks), saved
    unsigned: a fresh server opens it untrusted, as a colleague's would."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "%load_ext accel_magics", RECORD_CELL, f"from IPython.display import HTML\nHTML({SENTINEL!r})")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    html = [o["data"]["text/html"] for o in nb.cells[1].outputs if "text/html" in o.get("data", {})]
    assert html and "accel-magics-summary" in html[-1], nb.cells[1].outputs
    nbformat.write(nb, path)
    # The nbconvert HTML export: each rank's lines monospace and unspaced there too.
    from nbconvert import HTMLExporter
    exported, _ = HTMLExporter().from_notebook_node(nb)
    pres = re.findall(r"<pre class='accel-magics-pre' style='([^']*)'>rank 0 epoch 0", exported)
    assert pres and "font-family:monospace" in pres[0] and "margin:0" in pres[0], pres


def _check_record(cell, what: str) -> dict:
    seen = cell.evaluate(RECORD_JS)
    assert seen and len(seen["rows"]) == 2, (what, seen)
    for row in seen["rows"]:
        top, height = row["row"][1], row["row"][3]
        assert height < 40, (what, "a row in more than one line", row)
        assert all(abs(p[1] - top) < 20 for p in row["parts"]), (what, "a row's parts stacked", row)
        widths = sorted(round(fill / track, 2) for track, fill, fill_h in row["fills"])
        assert widths == [0.75, 1.0], (what, "bar fills", row["fills"])
        assert all(fill_h >= 5 for _, _, fill_h in row["fills"]), (what, "zero-height bars", row["fills"])
    assert "monospace" in seen["pre"].lower(), (what, seen["pre"])
    return seen


@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_a_saved_record_reads_right_untrusted_in_a_fresh_server(app, tmp_path):
    """Issue 25 item 1: opened by anyone else (untrusted), the record lost its
    <style>: every bar fill a zero-height div, each row's parts stacked.
    Now it is styled inline with what the sanitizer keeps; light and dark."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab(app)
    _record_notebook(lab.root / "record.ipynb")
    name = "lab" if app == "jupyterlab" else "nb7"
    with _lab_page(lab, {"width": 1200, "height": 900}, f"failure-untrusted-{name}.png") as page:
        page.goto(lab.url("record.ipynb"))
        cells = page.locator(".jp-Cell.jp-CodeCell")
        cells.nth(2).locator(".jp-OutputArea-output").first.wait_for()
        assert cells.nth(2).evaluate("c => c.querySelectorAll('style').length") == 0, "the notebook is trusted"
        record = cells.nth(1)
        record.locator(".accel-magics-summary").wait_for()
        light = _check_record(record, f"{app} light")
        record.screenshot(path=str(ARTIFACTS / f"11-untrusted-record-{name}-light.png"))
        if app == "jupyterlab":
            page.keyboard.press("Control+Shift+C")
            page.keyboard.type("JupyterLab Dark")
            page.keyboard.press("Enter")
        else:
            page.locator("text=Settings").first.click()
            page.locator("text=Theme").first.hover()
            page.locator("text=JupyterLab Dark").first.click()
        page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
        dark = _check_record(record, f"{app} dark")
        assert dark["track"] == light["track"] and "0.3" in dark["track"], (light["track"], dark["track"])
        record.screenshot(path=str(ARTIFACTS / f"12-untrusted-record-{name}-dark.png"))


# -- issue 25, view round 3 ---------------------------------------------------------

KERNEL_READY_JS = """() => {
    const p = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
    const i = p && p.querySelector('.jp-Notebook-ExecutionIndicator');
    const k = p && p.querySelector('.jp-Toolbar-kernelName');
    return !!(i && k && i.dataset.status === 'idle' && !/No Kernel|Connecting/.test(k.textContent));
}"""


def _wait_kernel(page, lab: Lab) -> None:
    """The notebook's kernel is connected and idle: JupyterLab and Notebook 7
    (no status bar there) alike."""
    page.wait_for_function(KERNEL_READY_JS)
    deadline = time.monotonic() + 60
    while not lab.kernel_idle():
        assert time.monotonic() < deadline, "the kernel did not become idle"
        time.sleep(0.2)


def _write_notebook(lab: Lab, name: str, cells) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, lab.root / name)


def _dark_theme(page) -> None:
    """The JupyterLab Dark theme from the command palette (Notebook 7 has it too)."""
    page.keyboard.press("Control+Shift+C")
    page.locator(".lm-CommandPalette-input:visible").wait_for()
    page.keyboard.type("JupyterLab Dark")
    page.keyboard.press("Enter")
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")


def _running(cell) -> bool:
    return cell.locator(".jp-InputArea-prompt").inner_text().strip().startswith("[*]")


EIGHT_CELL = (
    "%%distributed -n 8 --oversubscribe\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "rank = int(os.environ['RANK'])\n"
    "for step in tqdm(range(60), desc='train'):\n"
    "    time.sleep(0.2 if rank == 5 else 0.1)\n"
    "print('config: lr 0.1')\n"
    "print('done')\n"
)
COMPACT_JS = """c => {
    const run = c.querySelector('.accel-magics-run');
    if (!run) return null;
    const shown = e => e.offsetParent !== null && e.getBoundingClientRect().height > 0;
    const outside = e => !e.closest('.accel-magics-fold');
    const fold = run.querySelector('.accel-magics-fold');
    const contents = fold && fold.querySelector('.jupyter-widget-Collapse-contents');
    return {aggregates: [...run.querySelectorAll('.accel-magics-aggregate')].map(e => e.innerText),
            rows: [...run.querySelectorAll('.accel-magics-row')].filter(e => outside(e) && shown(e))
                      .map(e => e.querySelector('.accel-magics-label').innerText.trim()),
            tabs: [...run.querySelectorAll('.lm-TabBar-tab')].filter(outside).map(t => t.innerText.trim()),
            folds: run.querySelectorAll('.accel-magics-fold').length,
            foldTitle: fold ? fold.querySelector('.jupyter-widget-Collapse-header').innerText.trim() : null,
            foldOpen: !!(contents && shown(contents)),
            foldRows: fold ? [...fold.querySelectorAll('.accel-magics-row')].filter(shown).length : 0,
            foldTabs: fold ? [...fold.querySelectorAll('.lm-TabBar-tab')].filter(shown)
                                 .map(t => t.innerText.trim()) : []};
}"""
LIGHT_TEXT_JS = """s => { const m = getComputedStyle(s).color.match(/\\d+(\\.\\d+)?/g).map(Number);
    return (0.299 * m[0] + 0.587 * m[1] + 0.114 * m[2]) / 255; }"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_eight_ranks_use_the_compact_form_and_the_record_folds_identical_ranks(app):
    """Issue 25 (view round 3), many ranks: 8 ranks live are one aggregate
    row (slowest and fastest rank), at most 4 rows of their own and one "all
    ranks" tab; every row and rank tab are in a fold that opens in the
    browser while the cell runs.  The record folds the ranks whose output is
    the same into one block, the rows into a <details>; light and dark."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab(app)
    name = "lab" if app == "jupyterlab" else "nb7"
    _write_notebook(lab, "eight.ipynb", ("%load_ext accel_magics", EIGHT_CELL))
    with _lab_page(lab, {"width": 1300, "height": 1100}, f"failure-eight-{name}.png") as page:
        page.goto(lab.url("eight.ipynb"))
        _wait_kernel(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        # Live: the ranks apart (rank 5 is half as fast), so the aggregate names
        # both ends, and rank 5 is behind: its row is shown on its own.
        page.wait_for_function("""c => { const a = c.querySelector('.accel-magics-run .accel-magics-aggregate');
            return !!a && /slowest: rank 5/.test(a.innerText) && /fastest: rank/.test(a.innerText)
                   && /behind 5/.test(a.innerText); }""", arg=cell.element_handle())
        seen = cell.evaluate(COMPACT_JS)
        assert seen is not None and _running(cell), f"the run ended before the live view was seen: {seen}"
        assert len(seen["aggregates"]) == 1, seen
        agg = seen["aggregates"][0]
        assert "8 ranks" in agg and "slowest: rank" in agg and "fastest: rank" in agg, seen
        assert 1 <= len(seen["rows"]) <= 4 and any(r.startswith("rank 5 ") for r in seen["rows"]), \
            f"not the rows that need a look (rank 5 behind; at most 4) outside the fold: {seen}"
        assert seen["tabs"] == ["all ranks"], f"the main tab bar: {seen['tabs']}"
        assert seen["folds"] == 1 and not seen["foldOpen"] and seen["foldRows"] == 0, f"the fold: {seen}"
        cell.screenshot(path=str(ARTIFACTS / f"13-eight-ranks-compact-{name}.png"))
        # The fold opens in the browser alone (the kernel is busy running the cell).
        cell.locator(".accel-magics-fold .jupyter-widget-Collapse-header").click()
        page.wait_for_function(f"c => ({COMPACT_JS})(c)?.foldRows === 8", arg=cell.element_handle(),
                               timeout=30_000)
        opened = cell.evaluate(COMPACT_JS)
        assert opened and _running(cell), f"the run ended before the fold was seen open: {opened}"
        assert opened["foldOpen"] and opened["foldRows"] == 8, opened
        assert opened["foldTabs"] == [f"rank {r}" for r in range(8)], f"the fold's tabs: {opened['foldTabs']}"
        cell.screenshot(path=str(ARTIFACTS / f"14-eight-ranks-fold-opened-{name}.png"))

        # The record: one block for the ranks whose output is the same (the
        # finished bar's line differs only in its times), the rows in a <details>.
        _wait_done(page, 1)
        summary = cell.locator(".accel-magics-summary")
        summary.wait_for()
        text = summary.inner_text()
        assert re.search(r"ranks [\d, -]+ output \(3 lines, the same on each", text), text
        assert text.count(" output (") == 1, f"the identical ranks are not one block: {text}"
        rows = summary.locator("details", has=page.locator("summary", has_text="each of the 8 ranks' rows"))
        assert rows.count() == 1, text
        assert rows.locator(".accel-magics-row").count() == 8, rows.inner_html()
        assert cell.locator(".accel-magics-run").count() == 0
        cell.screenshot(path=str(ARTIFACTS / f"15-eight-ranks-record-{name}.png"))

        # Its rows open in the browser; then the dark theme.
        rows.locator("summary").click()
        page.wait_for_function("""d => d.open && [...d.querySelectorAll('.accel-magics-row')]
            .filter(r => r.getBoundingClientRect().height > 0).length === 8""", arg=rows.element_handle())
        _dark_theme(page)
        page.wait_for_function(f"s => ({LIGHT_TEXT_JS})(s) > 0.6", arg=summary.element_handle())
        cell.screenshot(path=str(ARTIFACTS / f"16-eight-ranks-record-{name}-dark.png"))
        track = summary.locator(".accel-magics-track").first
        color = track.evaluate("e => getComputedStyle(e).backgroundColor")
        assert color not in ("rgb(238, 238, 238)", "rgb(255, 255, 255)"), color


NARROW_CELL = (
    "%%distributed -n 2\n"
    "import os, time\n"
    "from tqdm.auto import tqdm\n"
    "rank = os.environ['RANK']\n"
    "for step in tqdm(range(30), desc='train'):\n"
    "    time.sleep(0.1)\n"
    "    print(f'epoch {step} loss 0.3 | acc 0.91 | lr 0.001 | grad-norm 1.234 | tokens/s 12345 | rank {rank}')\n"
)
# What a narrow output area must not do: a box past its right edge, or text
# clipped by an overflow:hidden box (the latest line is an excerpt by design:
# cut with an ellipsis, whole in its title and in the pane).
CLIPPED_JS = """c => {
    const area = c.querySelector('.jp-OutputArea');
    const edge = area.getBoundingClientRect().right;
    const what = e => e.tagName.toLowerCase() + [...e.classList].map(k => '.' + k).join('') + ': '
                      + (e.textContent || '').trim().slice(0, 50);
    const past = [], clipped = [];
    for (const e of area.querySelectorAll('*')) {
        const r = e.getBoundingClientRect();
        if (r.width === 0) continue;
        if (r.right > edge + 1) past.push([what(e), r.right, edge]);
        const s = getComputedStyle(e);
        // An excerpt cut on purpose (an ellipsis, the whole text in its tooltip) is not clipped.
        const excerpt = (e.classList.contains('accel-magics-latest') || e.classList.contains('accel-magics-bartext'))
            && s.textOverflow === 'ellipsis' && e.title === (e.textContent || '');
        if (['hidden', 'clip'].includes(s.overflowX) && e.scrollWidth > e.clientWidth + 1 && !excerpt)
            clipped.push([what(e), e.scrollWidth, e.clientWidth]);
    }
    const panel = c.closest('.jp-NotebookPanel').getBoundingClientRect();
    return {edge, panelRight: panel.right, width: area.getBoundingClientRect().width, past, clipped,
            tabs: [...area.querySelectorAll('.lm-TabBar-tab')].filter(t => t.offsetParent !== null).map(t => {
                const l = t.querySelector('.lm-TabBar-tabLabel') || t;
                return [l.innerText.trim(), l.scrollWidth, l.clientWidth]; })};
}"""
# A soft-wrapped line of a <pre> starts after a space (or a hyphen), never inside a word.
PRE_BREAKS_JS = """c => {
    const pres = [...c.querySelectorAll('.jp-OutputArea .accel-magics-pre')]
        .filter(p => p.getBoundingClientRect().width > 0);
    const breaks = [], wraps = [];
    for (const pre of pres) {
        const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT), range = document.createRange();
        let prevTop = null, prev = '\\n', n = 0;
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const text = node.data;
            for (let i = 0; i < text.length; i++) {
                if (text[i] === '\\n') { prev = '\\n'; prevTop = null; continue; }
                range.setStart(node, i); range.setEnd(node, i + 1);
                const r = range.getClientRects()[0];
                if (!r) continue;
                if (prevTop !== null && r.top > prevTop + 2) {   // a soft-wrapped line starts here
                    n++;
                    if (!/[\\s-]/.test(prev))
                        breaks.push(text.slice(Math.max(0, i - 12), i) + '|' + text.slice(i, i + 12));
                }
                prevTop = r.top; prev = text[i];
            }
        }
        wraps.push(n);
    }
    return {breaks, wraps, styles: pres.map(p => getComputedStyle(p).wordBreak)};
}"""


def _check_nothing_clipped(cell, what: str) -> dict:
    seen = cell.evaluate(CLIPPED_JS)
    assert not seen["past"], (what, "past the output area's right edge", seen)
    assert not seen["clipped"], (what, "text clipped by an overflow:hidden box", seen)
    assert seen["edge"] <= seen["panelRight"] + 1, (what, "the output area runs under the right sidebar", seen)
    return seen


@pytest.mark.timeout(400)
def test_narrow_with_side_panels_nothing_is_clipped():
    """Issue 25 (view round 3), a narrow notebook: 1100 px with the file
    browser and the right sidebar open, ranks printing long lines.  Live and
    in the record no box runs past the output area and no text is clipped
    (but the latest line's excerpt, ellipsised by design); the tab titles are
    whole; the record's <pre> lines wrap at spaces, never inside a word."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    _write_notebook(lab, "narrow.ipynb", ("%load_ext accel_magics", NARROW_CELL))
    with _lab_page(lab, {"width": 1100, "height": 1000}, "failure-narrow.png") as page:
        page.goto(lab.url("narrow.ipynb"))
        _wait_idle(page, lab)
        page.locator(".jp-DirListing").first.wait_for()   # the file browser is open
        page.keyboard.press("Control+Shift+C")
        page.locator(".lm-CommandPalette-input:visible").wait_for()
        page.keyboard.type("Show Right Sidebar")
        page.keyboard.press("Enter")
        page.wait_for_function("""() => { const r = document.querySelector('#jp-right-stack');
            return !!r && !r.classList.contains('lm-mod-hidden') && r.getBoundingClientRect().width > 100; }""")
        right = page.evaluate("() => document.querySelector('#jp-right-stack').getBoundingClientRect().width")
        _run_cell(page, 0)
        _wait_done(page, 0)

        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        # Live, once the rows show the long lines and the pane has a few of them.
        page.wait_for_function("""c => { const r = c.querySelector('.accel-magics-run');
            return !!r && [...r.querySelectorAll('.accel-magics-latest')]
                              .filter(e => /grad-norm/.test(e.title)).length == 2
                   && (r.querySelector('.accel-magics-pane')?.innerText.match(/grad-norm/g) || []).length >= 4; }""",
                               arg=cell.element_handle())
        cell.scroll_into_view_if_needed()
        live = _check_nothing_clipped(cell, "live")
        assert cell.locator(".accel-magics-run").count() == 1 and _running(cell), "the run ended before seen live"
        assert [t[0] for t in live["tabs"]] == ["all ranks", "rank 0", "rank 1"], live["tabs"]
        assert all(scroll <= client + 1 for _, scroll, client in live["tabs"]), ("a tab title cut", live["tabs"])
        assert live["width"] < 700, f"not narrow: the output area is {live['width']} px (right sidebar {right} px)"
        page.screenshot(path=str(ARTIFACTS / "17-narrow-side-panels-live.png"))

        _wait_done(page, 1)
        summary = cell.locator(".accel-magics-summary")
        summary.wait_for()
        cell.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "18-narrow-side-panels-record.png"))
        closed = summary.locator("details:not([open]) > summary")
        while closed.count():
            closed.first.click()   # the long outputs are collapsed: open them to see their lines
        page.wait_for_function("""c => [...c.querySelectorAll('.accel-magics-summary details')].every(d => d.open)""",
                               arg=cell.element_handle())
        _check_nothing_clipped(cell, "record")
        pre = cell.evaluate(PRE_BREAKS_JS)
        assert pre["styles"] and all(s != "break-all" for s in pre["styles"]), pre
        assert max(pre["wraps"]) > 0, f"the record's lines did not wrap: nothing checked {pre}"
        assert not pre["breaks"], f"<pre> lines broken inside a word: {pre['breaks']}"
        summary.locator("details").first.scroll_into_view_if_needed()
        page.screenshot(path=str(ARTIFACTS / "19-narrow-side-panels-record-opened.png"))


# 20,000 lines a rank in bursts of 200 (a burst is far more than a pane keeps).
# The pause between bursts makes the flood last over 10 s, so the pane is seen
# 3 and 6 s into it (with 0.01 s pauses it was over in under 2 s here).
FLOOD_CELL = (
    "%%distributed -n 2\n"
    "import os, time\n"
    "r = os.environ['RANK']\n"
    "for i in range(20000):\n"
    "    print(f'rank {r} line {i}')\n"
    "    if i % 200 == 0:\n"
    "        time.sleep(0.1)\n"
)
SHOWN_PANE_JS = """c => { const p = [...c.querySelectorAll('.accel-magics-run .accel-magics-pane')]
    .find(e => e.offsetParent !== null && e.getBoundingClientRect().height > 0);
    if (!p) return null;
    // The lines on screen: inside the pane's scrolled box (it holds more than it shows).
    const box = p.getBoundingClientRect(), shown = [], held = [];
    for (const pre of p.querySelectorAll('pre')) {
        const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            let at = 0;
            for (const line of node.data.split('\\n')) {
                if (line.trim()) {
                    const range = document.createRange();
                    range.setStart(node, at); range.setEnd(node, at + line.length);
                    held.push(line);
                    if ([...range.getClientRects()].some(r => r.bottom > box.top + 2 && r.top < box.bottom - 2))
                        shown.push(line);
                }
                at += line.length + 1;
            }
        }
    }
    const count = (lines, r) => lines.filter(l => l.startsWith(`[rank ${r}]`)).length;
    return {tab: c.querySelector('.accel-magics-run .lm-TabBar-tab.lm-mod-current').innerText.trim(),
            rank0: count(shown, 0), rank1: count(shown, 1), held0: count(held, 0), held1: count(held, 1),
            first: shown[0], last: shown[shown.length - 1]}; }"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_the_all_ranks_pane_shows_both_ranks_under_a_flood(app):
    """Issue 25 (view round 3): 2 ranks printing 20,000 lines each, in bursts
    larger than the pane keeps: the "all ranks" pane showed only rank 0's
    lines.  Sampled through the flood (screenshots 3 and 6 s after its first
    line): once the pane holds both ranks' lines, the lines on screen (the
    pane holds more than its 300 px show) are both ranks' every time."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab(app)
    name = "lab" if app == "jupyterlab" else "nb7"
    _write_notebook(lab, "flood.ipynb", ("%load_ext accel_magics", FLOOD_CELL))
    with _lab_page(lab, {"width": 1300, "height": 1100}, f"failure-flood-{name}.png") as page:
        page.goto(lab.url("flood.ipynb"))
        _wait_kernel(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        page.wait_for_function(f"c => !!({SHOWN_PANE_JS})(c)?.last", arg=cell.element_handle(), polling=100)
        start = time.monotonic()   # the first line is on screen
        samples, shots = [], {3: "20", 6: "21"}
        while shots:
            seen = cell.evaluate(SHOWN_PANE_JS)
            at = time.monotonic() - start
            assert seen is not None, f"the run ended {at:.1f} s into the flood (samples: {samples})"
            samples.append((round(at, 1), seen))
            for due in [s for s in shots if at >= s]:
                cell.locator(".accel-magics-run").screenshot(
                    path=str(ARTIFACTS / f"{shots.pop(due)}-flood-{due}s-{name}.png"))
            time.sleep(0.25)
        assert _running(cell), f"the run ended before 6 s into the flood: {samples}"
        # Once the pane holds both ranks' lines, both ranks' are on screen.
        both = [(at, x) for at, x in samples if x["held0"] and x["held1"]]
        assert len(both) >= 10, f"the pane did not hold both ranks' lines: {samples}"
        one = [(at, x) for at, x in both if not (x["tab"] == "all ranks" and x["rank0"] and x["rank1"])]
        assert not one, (f"the pane showed one rank's lines only in {len(one)} of {len(both)} samples "
                         f"(the pane holds both ranks' lines; its 300 px show its newest): {one}")
        _wait_done(page, 1)
        text = cell.locator(".accel-magics-summary").inner_text()
        assert "rank 0 line 19999" in text and "rank 1 line 19999" in text, text


BACKGROUND_VALUE_CELL = (
    "%%distributed -n 2 --background\n"
    "import time\n"
    "time.sleep(3)\n"
    "'ok'\n"
)


@pytest.mark.timeout(400)
def test_a_background_cells_out_shows_the_final_state():
    """Issue 25 (view round 3): a background cell's value said "<background
    run In[2]: started ...>" for ever, in the notebook and in the saved file.
    It is a display the run updates in place when it ends: "done in ...: 'ok'",
    while or after another cell runs; saved so too."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    _write_notebook(lab, "background-value.ipynb",
                    ("%load_ext accel_magics", BACKGROUND_VALUE_CELL, "import time; time.sleep(5)"))
    with _lab_page(lab, {"width": 1300, "height": 1000}, "failure-background-value.png") as page:
        page.goto(lab.url("background-value.ipynb"))
        _wait_idle(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        _wait_done(page, 1)                     # returned at once: the handle
        bg = page.locator(CELL).nth(1)
        out = bg.locator(".jp-OutputArea")
        out.filter(has_text="<background run In[2]: started").wait_for()
        _run_cell(page, 2)                      # another cell runs meanwhile
        _wait_done(page, 2)
        page.wait_for_function("o => /done in/.test(o.innerText)", arg=out.element_handle())
        bg.locator(".accel-magics-summary").wait_for()   # the record replaced the live view
        text = out.inner_text()
        assert "'ok'" in text and "started" not in text, text
        assert text.count("<background run") == 1, f"not updated in place: {text}"
        bg.screenshot(path=str(ARTIFACTS / "22-background-value-final.png"))

        # Saved, the notebook says how the run ended too.
        page.keyboard.press("Control+S")
        path, saved = lab.root / "background-value.ipynb", ""
        deadline = time.monotonic() + 60
        while "done in" not in saved:
            assert time.monotonic() < deadline, f"the saved notebook does not say how the run ended: {saved}"
            time.sleep(0.25)
            try:
                cell = nbformat.read(path, as_version=4).cells[1]
            except Exception:   # read while it is written
                continue
            saved = "\n".join(o.get("data", {}).get("text/plain", "") if o.get("output_type") != "stream"
                              else o.get("text", "") for o in cell.outputs)
        assert "'ok'" in saved and "started" not in saved, saved


# -- issue 47, item 3: a rank paused at its breakpoint ---------------------------------

# Rank 1 stops only once rank 0 has reported (a rank closes its output right
# after its result): while rank 1 waits in the input box, the kernel reads
# nothing more, so a result still on its way would show only after the answer.
PAUSE_CELL = (
    "%%distributed -n 2 --timeout 120\n"
    "import os, time\n"
    "z = 7\n"
    "if os.environ['RANK'] == '1':\n"
    "    peer = next(p for p in open(f'/proc/{os.getppid()}/task/{os.getppid()}/children').read().split() if int(p) != os.getpid())\n"
    "    while os.path.exists(f'/proc/{peer}/fd/1'): time.sleep(0.01)\n"
    "    breakpoint()\n"
    "print('done', z)\n"
)
ROWS_JS = """c => [...c.querySelectorAll('.accel-magics-run .accel-magics-row')].map(r => ({
    label: r.querySelector('.accel-magics-label').innerText.trim(),
    line: (r.querySelector('.accel-magics-latest') || {}).innerText || '',
    height: r.getBoundingClientRect().height}))"""


def _asked(page, cell, n: int) -> str:
    """The cell's ``n``-th question's prompt, once its input box is there (an
    answered one stays in the output area, with what was typed)."""
    page.wait_for_function("c => c.querySelectorAll('.jp-Stdin-input').length >= %d" % n, arg=cell.element_handle())
    return cell.locator(".jp-Stdin-prompt").nth(n - 1).inner_text().strip()


def _answer(cell, n: int, line: str) -> None:
    box = cell.locator(".jp-Stdin-input").nth(n - 1)
    box.fill(line)
    box.press("Enter")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_a_breakpoint_asks_in_the_input_box_and_the_view_shows_the_paused_rank(app):
    """Issue 47, items 2 and 3: rank 1's breakpoint() asks in the cell's input
    box ("(Pdb rank 1)"); meanwhile its row says it is paused and where
    (rank 0's says done), both rows one line high; its pane shows pdb's
    answers; the record keeps the debugger session."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab(app)
    name = "lab" if app == "jupyterlab" else "nb7"
    _write_notebook(lab, "pause.ipynb", ("%load_ext accel_magics", PAUSE_CELL))
    with _lab_page(lab, {"width": 1200, "height": 1000}, f"failure-pause-{name}.png") as page:
        page.goto(lab.url("pause.ipynb"))
        _wait_kernel(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        cell = page.locator(CELL).nth(1)
        assert _asked(page, cell, 1) == "(Pdb rank 1)"
        page.wait_for_function("c => (%s)(c).some(r => /^rank 0 done/.test(r.label))" % ROWS_JS,
                               arg=cell.element_handle())
        rows = cell.evaluate(ROWS_JS)
        assert [r["label"] for r in rows] == ["rank 0 done", "rank 1 paused"], rows
        assert re.fullmatch(r"waits at its prompt \(Pdb\) in <module> \(Cell In\[2\]:8\): print\('done', z\) · type "
                            r"in the input box",
                            rows[1]["line"]), rows
        assert rows[0]["line"] == "done 7" and rows[0]["height"] == rows[1]["height"] < 40, rows
        head = cell.locator(".accel-magics-run .accel-magics-header").first.inner_text()
        assert head.startswith("paused") and "rank 1 waits at its prompt: type in the input box" in head, head
        cell.screenshot(path=str(ARTIFACTS / f"23-paused-rank-{name}.png"))

        _answer(cell, 1, "p z")
        assert _asked(page, cell, 2) == "(Pdb rank 1)"    # asked again, after printing 7
        cell.locator(".accel-magics-run .lm-TabBar-tab", has_text="rank 1").click()
        pane = cell.locator(".accel-magics-run .widget-tab-contents .widget-html:visible").first
        pane.filter(has_text="(Pdb) p z").wait_for()
        assert pane.inner_text().strip().endswith("(Pdb) p z\n7"), pane.inner_text()
        assert "rank 1 paused" in [r["label"] for r in cell.evaluate(ROWS_JS)]
        cell.screenshot(path=str(ARTIFACTS / f"24-paused-rank-pane-{name}.png"))

        _answer(cell, 2, "c")
        _wait_done(page, 1)
        summary = cell.locator(".accel-magics-summary")
        summary.wait_for()
        text = summary.inner_text()
        assert "(Pdb) p z\n7\n(Pdb) c\ndone 7" in text and "paused" not in text, text
        assert cell.locator(".accel-magics-run").count() == 0
        cell.screenshot(path=str(ARTIFACTS / f"25-paused-rank-record-{name}.png"))


# -- issue 47, item 1: %distributed_debug after a failed cell ----------------------------

POST_MORTEM_CELL = (
    "%%distributed -n 2 --timeout 120\n"
    "import os\n\n"
    "def f(x):\n"
    "    y = x * 2\n"
    "    raise ValueError('no good')\n\n"
    "if os.environ['RANK'] == '1':\n"
    "    f(21)\n"
)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_distributed_debug_asks_in_the_input_box_after_a_failed_cell(app):
    """The failed cell's error says %distributed_debug can open the rank; the
    magic's pdb prompt comes in its cell's input box ("(Pdb rank 1)"); p y
    shows 42 in the cell; q ends it and says so."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Lab(app)
    name = "lab" if app == "jupyterlab" else "nb7"
    _write_notebook(lab, "postmortem.ipynb", ("%load_ext accel_magics", POST_MORTEM_CELL, "%distributed_debug"))
    with _lab_page(lab, {"width": 1200, "height": 1000}, f"failure-postmortem-{name}.png") as page:
        page.goto(lab.url("postmortem.ipynb"))
        _wait_kernel(page, lab)
        _run_cell(page, 0)
        _wait_done(page, 0)
        _run_cell(page, 1)
        _wait_done(page, 1)
        failed = page.locator(CELL).nth(1)
        failed.get_by_text("opens a post-mortem (pdb) in rank 1's failing frame", exact=False).first.wait_for()
        _run_cell(page, 2)
        cell = page.locator(CELL).nth(2)
        assert _asked(page, cell, 1) == "(Pdb rank 1)"
        cell.get_by_text("raise ValueError('no good')", exact=False).first.wait_for()   # pdb's "->" line
        _answer(cell, 1, "p y")
        assert _asked(page, cell, 2) == "(Pdb rank 1)"
        cell.get_by_text("[rank 1] 42", exact=True).first.wait_for()
        cell.screenshot(path=str(ARTIFACTS / f"26-post-mortem-{name}.png"))
        _answer(cell, 2, "q")
        _wait_done(page, 2)
        cell.get_by_text("rank 1's post-mortem ended, and the rank with it.", exact=False).first.wait_for()
        cell.screenshot(path=str(ARTIFACTS / f"27-post-mortem-ended-{name}.png"))
