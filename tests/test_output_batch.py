"""OutputBatch: pipe bytes to lines and progress states, as a terminal shows them;
Excerpt: which of those lines the kernel is sent."""
from __future__ import annotations

import pytest

from accel_magics.kernel_ext.supervisor.output_batch import MAX_LINE_BYTES, VIEW_LINE_BYTES, Excerpt, OutputBatch, shorten_lines

pytestmark = pytest.mark.timeout(30)


def test_lines_split_across_reads_are_joined():
    out = OutputBatch()
    out.feed(b"hel")
    out.feed(b"lo\nwor")
    assert out.take() == (b"hello", None)
    out.feed(b"ld\n")
    assert out.take() == (b"world", None)


def test_carriage_returns_keep_the_last_state_and_report_progress():
    out = OutputBatch()
    out.feed(b"\r 10%|#")
    assert out.take() == (None, " 10%|#")
    out.feed(b"\r 50%|#####")
    out.feed(b"\r 90%|#########")
    assert out.take() == (None, " 90%|#########")
    assert out.take() == (None, None)                  # unchanged state: nothing new
    out.feed(b"\r100%|##########\nnext line\n")
    assert out.take() == (b"100%|##########\nnext line", None)


def test_windows_line_endings_and_invalid_utf8():
    out = OutputBatch()
    out.feed(b"a\r\n\xff\xfe\n")
    block, _ = out.take()
    assert block.split(b"\n") == [b"a", b"\xff\xfe"]   # decoded (with replacement) only where shown


def test_unfinished_line_is_flushed_at_end_and_long_lines_are_cut():
    out = OutputBatch()
    out.feed(b"x" * (MAX_LINE_BYTES * 2 + 10))
    out.end()
    block, _ = out.take()
    # One line, cut for the kernel, with a note; the log has every byte.
    assert block == b"x" * (VIEW_LINE_BYTES - 64) + b"... [%d more bytes of this line are in the rank's log]" % (
        MAX_LINE_BYTES * 2 + 10 - VIEW_LINE_BYTES + 64)
    assert shorten_lines(block) == block and len(block) <= VIEW_LINE_BYTES
    assert out.take_log() == b"x" * (MAX_LINE_BYTES * 2 + 10) + b"\n"


def test_a_huge_line_costs_bounded_memory_and_the_log_stays_exact():
    out = OutputBatch()
    chunk = b"0123456789" * 100_000            # 1 MB per read, 20 MB without a newline
    logged = []
    for _ in range(20):
        out.feed(chunk)
        logged.append(out.take_log())
        assert len(out.pending) <= MAX_LINE_BYTES
    out.feed(b"end\nnext\n")
    block, _ = out.take()
    logged.append(out.take_log())
    first, second = block.split(b"\n")
    assert len(first) <= VIEW_LINE_BYTES and first.endswith(b"%d more bytes of this line are in the rank's log]"
                                                             % (20 * len(chunk) + 3 - VIEW_LINE_BYTES + 64))
    assert second == b"next"
    assert b"".join(logged) == chunk * 20 + b"end\nnext\n"


def test_progress_states_stay_small_and_the_log_keeps_what_a_terminal_shows():
    out = OutputBatch()
    for i in range(10_000):                  # one tqdm line, 10k updates, no newline
        out.feed(b"\r %3d%%|###| %d/10000" % (i // 100, i))
    assert len(out.pending) < 100
    assert out.take() == (None, "  99%|###| 9999/10000")
    out.feed(b"\n")
    assert out.take() == (b"  99%|###| 9999/10000", None)
    assert out.take_log() == b"  99%|###| 9999/10000\n"
    for i in range(3):                       # print(i, end="\r")
        out.feed(b"%d\r" % i)
    assert out.take() == (None, "2")


def test_shorten_lines_is_exact_for_short_lines_and_marks_long_ones():
    short = b"a\nbb\nccc"
    assert shorten_lines(short) is short
    long = b"a\n" + "é".encode() * 3000 + b"\nz"
    lines = shorten_lines(long).split(b"\n")
    assert lines[0] == b"a" and lines[2] == b"z"
    assert lines[1].decode("utf-8").startswith("é" * 2000)   # cut at a character boundary: still UTF-8
    assert len(lines[1]) <= VIEW_LINE_BYTES
    assert b"more bytes of this line are in the rank's log" in lines[1]


def _lines(a: int, b: int) -> bytes:
    return b"\n".join(b"line %d" % i for i in range(a, b))


def test_excerpt_sends_the_head_whole_then_each_batchs_tail():
    ex = Excerpt(head=5, tail=3)
    assert ex.select(_lines(0, 2)) == [(0, _lines(0, 2))]              # within the head
    assert ex.select(_lines(2, 10)) == [(0, _lines(2, 5)), (2, _lines(7, 10))]
    assert ex.select(_lines(10, 12)) == [(0, _lines(10, 12))]          # a short batch: all of it
    assert ex.select(_lines(12, 1000)) == [(985, _lines(997, 1000))]


def test_excerpt_keeps_what_a_head_and_tail_record_shows():
    # Whatever the batching, the first `head` and last `tail` lines the
    # kernel keeps are those of the full output, and the count is exact.
    import random
    rng = random.Random(7)
    total = 5000
    ex = Excerpt(head=200, tail=800)
    head, tail, count, i = [], [], 0, 0
    while i < total:
        j = min(total, i + rng.choice([1, 3, 50, 700, 1500]))
        for omitted, part in ex.select(_lines(i, j)):
            lines = part.split(b"\n")
            count += omitted + len(lines)
            room = 200 - len(head)
            head += lines[:room]
            tail = (tail + lines[max(room, 0):])[-800:]
        i = j
    assert count == total
    assert head == _lines(0, 200).split(b"\n")
    assert tail == _lines(total - 800, total).split(b"\n")
