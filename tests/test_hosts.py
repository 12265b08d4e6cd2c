"""Notebook hosts (issue 45): what the views need from a frontend.

The views use ipywidgets' core models only.  A frontend renders a widget whose model and view live in a JavaScript module it
has: every widget manager (JupyterLab, Notebook, VS Code, Colab) bundles
ipywidgets' own (@jupyter-widgets/base, /controls, /output); anything else is
fetched from a CDN or needs Colab's custom widget manager, and fails offline.
So every widget model the progress view and the config form create, their
layouts and styles included, must be one of those, at the version the installed
ipywidgets speaks, and of a class ipywidgets defines (no subclass of ours that
could carry its own front-end code: ``_esm``, ``_view_module``).

Where no widget renders at all, a run still shows live text: the widget's own
display says so in its ``text/plain``, and the latest lines live in a display
that a widget manager hides (a widget view with an empty model_id) and any
other frontend shows as text (the browser test: tests/test_browser_hosts.py).
"""
from __future__ import annotations

import pytest
import traitlets

pytestmark = pytest.mark.timeout(60)

w = pytest.importorskip("ipywidgets")


def _live_widgets() -> dict:
    """model_id -> widget, for every widget the kernel holds (ipywidgets 8: a
    module registry; ipywidgets 7: ``Widget.widgets``)."""
    from ipywidgets.widgets import widget as module

    registry = getattr(module, "_instances", None)
    if registry is None:
        registry = w.Widget.widgets
    return dict(registry)


def _core_versions() -> dict:
    from ipywidgets import _version

    return {"@jupyter-widgets/base": _version.__jupyter_widgets_base_version__,
            "@jupyter-widgets/controls": _version.__jupyter_widgets_controls_version__,
            "@jupyter-widgets/output": getattr(_version, "__jupyter_widgets_output_version__", None)}


def _not_core(widgets) -> list[str]:
    core = _core_versions()
    bad = []
    for widget in widgets:
        where = f"{type(widget).__module__}.{type(widget).__qualname__} ({widget._model_name})"
        if not type(widget).__module__.startswith("ipywidgets."):
            bad.append(f"{where}: a class outside ipywidgets")
        for kind in ("model", "view"):
            module = getattr(widget, f"_{kind}_module")
            version = getattr(widget, f"_{kind}_module_version")
            if kind == "view" and widget._view_name is None:
                continue   # a model without a view of its own (Layout, a Style)
            if module not in core:
                bad.append(f"{where}: {kind} module {module}")
            elif core[module] is not None and version != core[module]:
                bad.append(f"{where}: {kind} module {module} {version}, ipywidgets speaks {core[module]}")
        if any(hasattr(widget, name) for name in ("_esm", "_css", "_anywidget_id")):
            bad.append(f"{where}: front-end code of its own")
    return bad


def _run_events(n: int, fail: bool):
    from accel_magics.kernel_ext.kernel import events as ev

    yield ev.RunStarted("r", 0, 0, n, 1, 0, list(range(n)), "127.0.0.1", 29500)
    for rank in range(n):
        yield ev.Output(rank, f"rank {rank} says hello\nloss 0.5")
        yield ev.Bar(rank, 1, 0, "epoch", 2, 4, "2/4", True, False)
        yield ev.Resources({rank: (50.0, 100 << 20, None)})
    yield ev.Heartbeat()
    failure = ev.RankFailure(n - 1, "exception", "ValueError: boom", "Traceback ...\nValueError: boom") if fail else None
    for rank in range(n):
        yield ev.RankExited(rank, 1 if failure and rank == n - 1 else 0, None, False,
                            failure if rank == n - 1 else None)
    yield ev.RunFinished("r", "failed" if fail else "ok", 1.0, root_cause=failure,
                         failures=[failure] if failure else [])


@pytest.mark.parametrize("n, fail", [(2, False), (8, True)], ids=["2 ranks", "8 ranks, compact, one failed"])
def test_every_widget_the_progress_view_creates_is_a_core_model(n, fail):
    from accel_magics.widgets.progress_view import RunView

    before = set(_live_widgets())
    view = RunView(log_dir="/logs/run-1")
    for event in _run_events(n, fail):
        view(event)
    view.refresh(force=True)
    view._refresh_panes(force=True)
    view.summary_html()
    created = [widget for key, widget in _live_widgets().items() if key not in before]
    assert len(created) >= 8, [type(x).__name__ for x in created]   # the view, its panes, their layouts
    assert view.compact == (n > 4)
    assert not _not_core(created)
    view.close()
    assert not set(_live_widgets()) - before   # and it closes them all


def test_every_widget_of_the_config_form_is_a_core_model():
    from accel_magics.widgets.config_form import ConfigForm

    before = set(_live_widgets())
    form = ConfigForm({}, check=lambda values: "", apply=lambda values: None, describe=lambda values: "")
    created = [widget for key, widget in _live_widgets().items() if key not in before]
    assert len(created) >= 10, [type(x).__name__ for x in created]
    assert not _not_core(created)
    for widget in created:
        widget.close()


def test_a_widget_with_its_own_front_end_code_is_caught():
    """The check itself: a custom model module, and a subclass of ours, are named."""
    class Custom(w.DOMWidget):
        _model_name = traitlets.Unicode("CustomModel").tag(sync=True)
        _model_module = traitlets.Unicode("my-widgets").tag(sync=True)
        _view_name = traitlets.Unicode("CustomView").tag(sync=True)
        _view_module = traitlets.Unicode("my-widgets").tag(sync=True)

    class Tinted(w.HTML):
        pass

    custom, tinted = Custom(), Tinted()
    try:
        bad = _not_core([custom, tinted])
        assert any("model module my-widgets" in b for b in bad) and any("view module my-widgets" in b for b in bad)
        assert any("Tinted" in b and "outside ipywidgets" in b for b in bad), bad
    finally:
        custom.close()
        tinted.close()


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def test_a_widget_run_keeps_live_text_only_a_frontend_without_widgets_shows(clean_kernel):
    res = clean_kernel.ok("%%distributed -n 2\nimport os\nfor i in range(3):\n    print('line', i, 'of', os.environ['RANK'])\n")
    shown = [m["content"] for m in res.messages if m["msg_type"] in ("display_data", "update_display_data")]
    view = shown[0]["data"]
    assert view[WIDGET_VIEW]["model_id"], view   # the live view itself, first
    assert view["text/plain"].startswith("[accel_magics] this frontend shows no widgets"), view
    texts = [c for c in shown if c["data"].get(WIDGET_VIEW, {}).get("model_id") == ""]
    assert len({c["transient"]["display_id"] for c in texts}) == 1, texts   # one display, updated
    lines = [c["data"]["text/plain"] for c in texts]
    assert any(all(f"[rank {r}] line 2 of {r}" in t for r in (0, 1)) for t in lines), lines
    assert lines[-1] == ""   # emptied at the end: the record follows
    record = [m["content"]["data"] for m in res.messages if m["msg_type"] == "display_data"][-1]
    assert "text/html" in record and "[rank 1] line 2 of 1" in record["text/plain"], record


@pytest.mark.parametrize("colab", [False, True])
def test_the_text_beside_the_view_is_left_out_on_colab(colab, monkeypatch, tmp_path, capsys):
    """Colab's own widget manager renders core widgets and is not known to hide
    an empty view: there the widget view stands alone."""
    import sys
    import types

    from accel_magics.presenter import Presenter

    monkeypatch.setenv("ACCEL_MAGICS_LOG_DIR", str(tmp_path))
    if colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    presenter = Presenter("widget", in_kernel=True, label="In[1]")   # (no shell: its displays go nowhere)
    try:
        assert presenter.view is not None
        assert (presenter.text is None) == colab
    finally:
        presenter.view.close()
