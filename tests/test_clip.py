"""Issue 45 item 5: nothing a person reads is cut mid-word."""
from __future__ import annotations

import re

import pytest

from accel_magics.kernel_ext.clip import ELLIPSIS, clip

pytestmark = pytest.mark.timeout(30)

SUMMARY = ("rank 1 failed: RuntimeError: Expected to have finished reduction in the prior iteration before "
           "starting a new one: torch.nn.parallel.distributed.DistributedDataParallel found unused parameters")


def _words(text: str) -> set:
    return set(re.findall(r"\w+", text))


@pytest.mark.parametrize("limit", range(12, len(SUMMARY), 7))
def test_a_cut_keeps_whole_words_and_says_where_it_cut(limit):
    for keep in ("head", "tail"):
        cut = clip(SUMMARY, limit, keep=keep)
        assert len(cut) <= limit and ELLIPSIS in cut
        assert _words(cut.replace(ELLIPSIS, " ")) <= _words(SUMMARY), (keep, cut)   # no piece of a word
        assert (cut.endswith(ELLIPSIS) if keep == "head" else cut.startswith(ELLIPSIS))


def test_what_fits_is_left_alone_and_one_long_token_is_cut_at_the_limit():
    assert clip(SUMMARY, len(SUMMARY)) == SUMMARY
    assert clip("x" * 50, 10) == "x" * 9 + ELLIPSIS


def test_a_long_value_in_a_background_handles_repr_is_cut_between_words():
    from accel_magics.background_handle import _short
    text = _short(repr(" ".join([SUMMARY] * 3)))
    assert text.endswith(ELLIPSIS) and _words(text.replace(ELLIPSIS, " ")) <= _words(SUMMARY), text


def test_a_long_error_line_sent_to_the_kernel_is_cut_between_words():
    from accel_magics.kernel_ext.supervisor.output_batch import bound_text
    line = ("word " * 2000).strip()
    cut = bound_text(line, line_chars=100)
    head, _, rest = cut.partition(ELLIPSIS)
    assert _words(head) == {"word"} and head.endswith("word") and \
        rest == f" [{len(line) - len(head)} more characters are in the rank's log]", cut


def test_a_failed_ranks_row_keeps_its_errors_type_whole_and_wraps():
    from accel_magics.kernel_ext.kernel import events as ev
    from accel_magics.widgets.progress_view import RunView

    view = RunView()
    try:
        summary = "torch.distributed.DistBackendError: " + "a long explanation of what went wrong " * 12
        view(ev.RankExited(0, 1, None, False, ev.RankFailure(0, "exception", summary)))
        row = view._rows_html(final=True)
        latest = re.search(r"class='accel-magics-latest' style='([^']*)'[^>]*>([^<]*)<", row)
        assert "white-space:normal" in latest.group(1)
        assert latest.group(2).startswith("torch.distributed.DistBackendError: a long") and latest.group(2).endswith(ELLIPSIS)
    finally:
        view.close()
