"""A rank paused at its prompt (a breakpoint's pdb, input()) in the views,
fed plain engine events (issue 47, item 3): the widget's row says which rank
waits and where, and the text view and the record keep the debugger
session's transcript in order with the rank's output.  The same in a real
kernel: tests/test_rank_stdin.py."""
from __future__ import annotations

import io
import re

import pytest

from accel_magics.kernel_ext.kernel import events as ev
from accel_magics.record import RunRecord
from accel_magics.text_view import StreamLive, TextView

pytestmark = pytest.mark.timeout(60)

WHERE = "> <%%distributed In[3]>(5)<module>()\n-> print('done', z)"   # pdb's lines before its prompt

# A session at rank 1's breakpoint: "p z", then "c".
SESSION = [
    ev.RunStarted("r", 0, 0, 2, 1, 0, [0, 1], "127.0.0.1", 29500),
    ev.Output(0, "step 0"),
    ev.Output(1, f"step 0\n{WHERE}"),
    ev.InputRequested(1, "(Pdb) "),
    ev.InputAnswered(1, "(Pdb) ", "p z"),
    ev.Output(1, "7"),
    ev.InputRequested(1, "(Pdb) "),
    ev.InputAnswered(1, "(Pdb) ", "c"),
    ev.Output(1, "done 7"),
    ev.Output(0, "done 7"),
]
PAUSED_AT = "waits at its prompt (Pdb) in &lt;module&gt; (&lt;%%distributed In[3]&gt;:5): print(&#x27;done&#x27;, z)"


def _row(view, rank: int) -> str:
    return re.search(rf"<div class='accel-magics-row'[^>]*><span class='accel-magics-label'[^>]*>rank {rank}\b.*?"
                     rf"(?=<div class='accel-magics-row'|$)", view.rows.value).group(0)


def _view(**kw):
    from accel_magics.widgets.progress_view import RunView

    return RunView(**kw)


def test_the_paused_rank_s_row_says_so_and_where_at_once_and_runs_again_when_answered():
    # interval: no refresh by time in this test, only the one a prompt forces
    # (the kernel then waits in the input box and refreshes nothing).
    view = _view(interval=3600, pane_interval=3600)
    for event in SESSION[:4]:
        view(event)
    row, other = _row(view, 1), _row(view, 0)
    assert ">paused</b>" in row and PAUSED_AT in row and "type in the input box" in row, row
    assert ">running</b>" in other and "paused" not in other, other
    assert view.ranks[1].state == "paused"
    head = view.header.value   # the run is paused: the header says so, and who waits
    assert ">paused</b>" in head and "rank 1 waits at its prompt: type in the input box" in head, head
    assert "-&gt; print(&#x27;done&#x27;, z)" in view._pane_widgets[1].value   # its pane shows pdb's lines now

    view(SESSION[4])   # "p z": it runs again, the exchange a line of its output
    assert view.ranks[1].state == "running" and view.ranks[1].paused == ""
    view.refresh(force=True)
    assert ">running</b>" in view.header.value and "prompt" not in view.header.value, view.header.value
    assert list(view.ranks[1].lines)[-1] == "(Pdb) p z"
    view(SESSION[5])
    view(SESSION[6])   # asked again after printing 7: still where pdb said last
    assert PAUSED_AT in _row(view, 1)
    for event in SESSION[7:]:
        view(event)
    view(ev.RankExited(0, 0, None, False))
    view(ev.RankExited(1, 0, None, False))
    view(ev.RunFinished("r", "ok", 1.0))
    assert "paused" not in view.rows.value and "waits at its prompt" not in view.rows.value
    record = view.summary_html()
    assert "waits at its prompt" not in record
    assert ("step 0\n&gt; &lt;%%distributed In[3]&gt;(5)&lt;module&gt;()\n-&gt; print(&#x27;done&#x27;, z)\n"
            "(Pdb) p z\n7\n(Pdb) c\ndone 7") in record, record
    view.close()


def test_a_paused_row_keeps_the_shape_of_a_running_one():
    """The pause takes the place of the latest line: no part added, so the
    row (and the view) keeps its height."""
    view = _view()
    for event in SESSION[:3]:
        view(event)
    view.refresh(force=True)
    running = _row(view, 1)
    view(SESSION[3])
    paused = _row(view, 1)
    shape = lambda row: re.findall(r"class='accel-magics-(\w+)'", row)   # noqa: E731
    assert shape(paused) == shape(running) == ["row", "label", "latest"], (running, paused)
    latest = re.search(r"class='accel-magics-latest' style='([^']*)'", paused).group(1)
    assert "white-space:nowrap" in latest and "text-overflow:ellipsis" in latest
    view.close()


def test_an_input_prompt_says_the_prompt_and_no_debugger_location():
    """input('name? ') is no debugger: a user's line that looks like pdb's is not where it waits."""
    view = _view()
    view(ev.Output(0, "> data(3)load()\nready"))
    view(ev.InputRequested(0, "name? "))
    row = _row(view, 0)
    assert "waits at its prompt name? · type in the input box" in row and "load" not in row.split("paused")[1], row
    view(ev.InputAnswered(0, "name? ", "Ada"))
    view(ev.InputRequested(0, "again? "))
    view(ev.InputAnswered(0, "again? ", None, "this frontend takes no input"))
    assert list(view.ranks[0].lines)[-2:] == ["name? Ada", "again? <end of input: this frontend takes no input>"]
    assert view.ranks[0].state == "running"
    view.close()


def test_many_ranks_show_the_paused_one_beside_the_aggregate():
    view = _view()
    view(ev.RunStarted("r", 0, 0, 8, 1, 0, list(range(8)), "127.0.0.1", 29500))
    for rank in range(8):
        view(ev.Output(rank, "step 0" if rank != 6 else f"step 0\n{WHERE}"))
    view(ev.InputRequested(6, "(Pdb) "))
    rows = view.rows.value
    assert ">paused</b> 6" in rows and ">running</b> 0-5, 7" in rows, rows
    assert rows.count("class='accel-magics-row'") == 1 and PAUSED_AT in _row(view, 6)
    view.close()


def test_a_prompt_of_a_rank_that_already_ended_marks_nothing():
    view = _view()
    view(ev.Output(1, WHERE))
    view(ev.RankExited(1, 1, None, True))
    view(ev.InputRequested(1, "(Pdb) "))
    assert view.ranks[1].state == "stopped" and "paused" not in view.rows.value
    view.close()


def test_the_text_view_and_the_record_keep_the_transcript_in_order_with_the_output():
    out = io.StringIO()
    text, record = TextView(StreamLive(out)), RunRecord()
    for event in SESSION:
        text(event)
        record(event)
    rank_1 = ["[rank 1] step 0", "[rank 1] > <%%distributed In[3]>(5)<module>()", "[rank 1] -> print('done', z)",
              "[rank 1] (Pdb) p z", "[rank 1] 7", "[rank 1] (Pdb) c", "[rank 1] done 7"]
    assert [line for line in out.getvalue().splitlines() if line.startswith("[rank 1] ")] == rank_1
    assert record.render().splitlines() == ["[rank 0] step 0", "[rank 0] done 7", *rank_1]


def test_end_of_input_is_in_the_transcript_with_its_reason():
    record = RunRecord()
    record(ev.InputAnswered(0, "(Pdb) ", None, "this frontend takes no input"))
    assert record.render() == "[rank 0] (Pdb) <end of input: this frontend takes no input>\n"


class _Sink:
    """A live sink that notes what the text view asks of it."""

    keeps_record = True

    def __init__(self) -> None:
        self.calls: list = []

    def write(self, lines):
        self.calls.append(("write", lines))

    def refresh(self):
        self.calls.append(("refresh",))


def test_the_text_view_shows_its_lines_before_the_kernel_waits_in_the_input_box():
    sink = _Sink()
    view = TextView(sink)
    view(ev.Output(1, WHERE))
    view(ev.InputRequested(1, "(Pdb) "))
    assert sink.calls[-1] == ("refresh",), sink.calls
