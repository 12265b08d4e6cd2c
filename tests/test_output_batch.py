"""OutputBatch: pipe bytes to lines and progress states, as a terminal shows them."""
from __future__ import annotations

import pytest

from kernel_ext.output_batch import MAX_LINE_BYTES, OutputBatch

pytestmark = pytest.mark.timeout(30)


def test_lines_split_across_reads_are_joined():
    out = OutputBatch()
    out.feed(b"hel")
    out.feed(b"lo\nwor")
    assert out.take() == ("hello", None)
    out.feed(b"ld\n")
    assert out.take() == ("world", None)


def test_carriage_returns_keep_the_last_state_and_report_progress():
    out = OutputBatch()
    out.feed(b"\r 10%|#")
    assert out.take() == (None, " 10%|#")
    out.feed(b"\r 50%|#####")
    out.feed(b"\r 90%|#########")
    assert out.take() == (None, " 90%|#########")
    assert out.take() == (None, None)                  # unchanged state: nothing new
    out.feed(b"\r100%|##########\nnext line\n")
    assert out.take() == ("100%|##########\nnext line", None)


def test_windows_line_endings_and_invalid_utf8():
    out = OutputBatch()
    out.feed(b"a\r\n\xff\xfe\n")
    text, _ = out.take()
    assert text.split("\n") == ["a", "\ufffd\ufffd"]


def test_unfinished_line_is_flushed_at_end_and_long_lines_are_cut():
    out = OutputBatch()
    out.feed(b"x" * (MAX_LINE_BYTES * 2 + 10))
    out.end()
    text, _ = out.take()
    assert [len(p) for p in text.split("\n")] == [MAX_LINE_BYTES, MAX_LINE_BYTES, 10]
