"""Payload building: which globals travel, and the errors before launch."""
from __future__ import annotations

import os
import pickle
import threading

import pytest

from accel_magics.kernel_ext.wire.payload import PayloadError, build_payload

pytestmark = pytest.mark.timeout(30)


def test_ships_only_referenced_globals_and_functions_by_value():
    def helper(x):
        return x * FACTOR  # noqa: F821 - resolved from the namespace below

    ns = {"FACTOR": 3, "helper": helper, "unused": object(), "np_like": pickle}
    p = build_payload("y = helper(2)\nimport math\nprint(np_like.HIGHEST_PROTOCOL)", ns)
    assert p.shipped_names == ["helper", "np_like"]
    shipped = {}
    p.load_into(shipped)
    assert shipped["np_like"] is pickle            # modules by reference


def test_names_bound_in_the_cell_are_not_undefined():
    src = (
        "import os\nfrom math import sqrt as root\n"
        "def f(a, *args, b=1, **kw):\n    return a + missing_inside_function\n"
        "class C:\n    attr = 1\n    other = attr + 1\n"
        "for i in range(3):\n    pass\n"
        "try:\n    pass\nexcept Exception as err:\n    print(err)\n"
        "with open(os.devnull) as fh:\n    pass\n"
        "total = sum(j for j in range(3))\n"
        "if (n := 3):\n    print(n, i, root, C, f, fh, total)\n"
    )
    build_payload(src, {})   # no error: every top-level name is bound somewhere


def test_undefined_name_is_refused_with_advice():
    with pytest.raises(PayloadError, match="'nowhere' is not defined") as info:
        build_payload("print(nowhere)", {})
    assert "earlier cell" in str(info.value)


def test_star_import_disables_the_undefined_check():
    build_payload("from math import *\nprint(pi)", {})


def test_unpicklable_global_is_named_with_advice():
    ns = {"lock": threading.Lock(), "ok": 1}
    with pytest.raises(PayloadError) as info:
        build_payload("print(lock, ok)", ns)
    msg = str(info.value)
    assert "cannot send variable 'lock' (_thread.lock)" in msg
    assert "Create 'lock' inside the %%distributed cell" in msg
    assert "'ok'" not in msg


def test_excluded_frontend_names_never_travel():
    p = build_payload("print(In, x)", {"In": ["history"], "x": 1}, exclude={"In"})
    assert p.shipped_names == ["x"]


def test_syntax_error_has_cell_line_numbers():
    with pytest.raises(SyntaxError) as info:
        build_payload("# magic line\nx = 1\ny = = 2\n", {})
    assert info.value.lineno == 3


def test_annotations_and_defaults_are_shipped():
    p = build_payload("def f(x: MyType = DEFAULT) -> Out:\n    return x\n",
                      {"MyType": int, "DEFAULT": 4, "Out": str})
    assert p.shipped_names == ["DEFAULT", "MyType", "Out"]


def _add(arena, array) -> None:
    """Put ``array``'s bytes in ``arena`` as the pickler does a buffer of it."""
    arena.add(memoryview(array).cast("B"), (array.ctypes.data, array.nbytes))


def test_kept_shared_memory_stays_within_its_budget():
    """A kept buffer's shared memory stays taken between cells, so the cache
    keeps at most its budget (a quarter of the machine's memory); beyond it
    a buffer's memory is its run's alone, as before.  What this payload uses
    is never pushed out; what it does not use gives way to what it does."""
    import numpy as np

    from accel_magics.kernel_ext.wire.payload import SharedArena, SharedCache

    cache = SharedCache(budget=40 << 20)
    first, second = np.ones(3 << 20), np.ones(3 << 20)   # 24 MB each
    for _ in range(2):
        cache.next_payload()
        arena = SharedArena(cache)
        _add(arena, first)
        _add(arena, second)
        assert len(cache) == 1 and cache.kept_bytes() == 24 << 20
        arena.close()
    cache.next_payload()
    arena = SharedArena(cache)
    _add(arena, second)   # first's entry, unused by this payload, makes room
    assert len(cache) == 1 and cache.kept_bytes() == 24 << 20
    arena.close()
    cache.clear()
    assert len(cache) == 0


def _memfds() -> int:
    """Descriptors of this process open on a big global's shared memory."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "accel_magics-globals" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return count


@pytest.mark.parametrize("case", ["new array", "kept, unchanged", "kept, changed in place", "over the budget"])
def test_an_interrupt_at_any_line_of_sharing_a_big_global_leaks_no_descriptor(case, sigint_raises):
    """The stop button can land between any two lines of the kernel's work on
    a big global (a memfd made, its lock taken, the run's descriptor handed
    to the arena): each line is tried in turn, with a real SIGINT sent to
    this process at that line, and afterwards every descriptor of shared
    memory left open is one the cache keeps (one per kept array), none lost.
    Before descriptors changed hands under ``sigint_deferred`` an interrupt
    between ``hold()`` and the arena's list leaked the run's descriptor, and
    its lock kept that memory from being updated in place ever again."""
    import gc
    import signal
    import sys

    import numpy as np

    from accel_magics.kernel_ext.wire.payload import SharedArena, SharedCache

    watched = ("wire/payload.py", "kernel_ext/sigint.py")
    probe = SharedCache()
    arena = SharedArena(probe)
    owner = np.ones(1 << 17)
    _add(arena, owner)
    arena.close()
    per_entry = _memfds()   # the memfd, and its mapping's own descriptor
    probe.clear()
    del owner
    assert per_entry >= 1 and _memfds() == 0
    cache = SharedCache(budget=0 if case == "over the budget" else 64 << 20)
    kept = np.ones(1 << 17)   # 1 MB
    if case.startswith("kept"):
        arena = SharedArena(cache)
        _add(arena, kept)
        arena.close()
        assert len(cache) == 1

    def attempt(interrupt_at: int) -> tuple[int, bool]:
        array = np.ones(1 << 17) if case in ("new array", "over the budget") else kept
        if case == "kept, changed in place":
            array[0] += 1
        lines = [0]

        def tracer(frame, event, arg):
            if not frame.f_code.co_filename.endswith(watched):
                return None
            if event == "line":
                lines[0] += 1
                if lines[0] == interrupt_at:
                    os.kill(os.getpid(), signal.SIGINT)
            return tracer

        arena = SharedArena(cache)
        interrupted = False
        sys.settrace(tracer)
        try:
            _add(arena, array)
            for _ in range(1000):   # bytecodes: a signal sent at the last line is handled by here
                pass
        except KeyboardInterrupt:
            interrupted = True
        finally:
            sys.settrace(None)
            arena.close()
        del array
        return lines[0], interrupted

    try:
        total, interrupted = attempt(0)
        assert not interrupted and total > 10, total
        assert _memfds() == per_entry * len(cache)
        for at in range(1, total + 1):
            _, interrupted = attempt(at)
            assert interrupted, f"the interrupt at line event {at} of {total} was lost"
            assert _memfds() == per_entry * len(cache), f"an interrupt at line event {at} of {total} leaked a descriptor"
    finally:
        cache.clear()
    # The tracer is a closure that refers to itself, and the interrupt's
    # handler ran in its frame: cycles of the test's own, holding the frames
    # it saw (a comparison's view of the memory among them) until collected.
    gc.collect()
    assert _memfds() == 0


def test_a_big_globals_comparison_finds_every_differing_chunk_on_every_thread(monkeypatch):
    """The kernel compares a kept array with its shared copy on several
    threads (memcmp, the GIL let go), each taking every n-th chunk: every
    differing chunk is found whichever thread had it, the odd-sized last one
    too; an interrupt on the main thread ends the comparison with no thread
    left running over memory that may go next."""
    import threading

    import numpy as np

    from accel_magics.kernel_ext.wire import payload
    from accel_magics.kernel_ext.wire.payload import SharedCache

    cache = SharedCache()
    cache.CHUNK, cache.COMPARE_THREADS = 4096, 3
    mine = np.zeros(4096 * 7 + 5, np.uint8)
    theirs = mine.copy()
    for at in (4096 * 1 + 9, 4096 * 3, 4096 * 5 + 4095, 4096 * 7 + 4):
        theirs[at] = 1

    class Held:
        calls = 0
        raise_at = None

        def deliver(self):
            Held.calls += 1
            if Held.calls == Held.raise_at:
                raise KeyboardInterrupt

    found = cache._differing_chunks(mine.ctypes.data, theirs.ctypes.data, mine.nbytes, Held())
    assert found == [4096 * 1, 4096 * 3, 4096 * 5, 4096 * 7]
    # The main thread's part done first (its helpers' compares wait for it):
    # the helpers still compare all of theirs.
    real = payload._memcmp()
    main_done = threading.Event()
    main_calls = []

    def ordered(a, b, n):
        if threading.current_thread() is threading.main_thread():
            result = real(a, b, n)
            main_calls.append(a)
            if len(main_calls) == 4:   # chunks 0, 2, 4, 6 of 8, on 2 threads
                main_done.set()
            return result
        assert main_done.wait(30)
        return real(a, b, n)

    monkeypatch.setattr(payload, "_memcmp", lambda: ordered)
    cache.COMPARE_THREADS = 2
    if len(os.sched_getaffinity(0)) >= 2:
        found = cache._differing_chunks(mine.ctypes.data, theirs.ctypes.data, mine.nbytes, Held())
        assert len(main_calls) == 4 and found == [4096 * 1, 4096 * 3, 4096 * 5, 4096 * 7]
    monkeypatch.undo()
    assert cache._differing_chunks(mine.ctypes.data, mine.copy().ctypes.data, mine.nbytes, Held()) == []
    Held.calls, Held.raise_at = 0, 2
    with pytest.raises(KeyboardInterrupt):
        cache._differing_chunks(mine.ctypes.data, theirs.ctypes.data, mine.nbytes, Held())
    assert not [t for t in threading.enumerate() if t.name == "accel_magics-compare"]


# -- values as cloudpickle delivers them (issue 44 item 4) -------------------------------

@pytest.fixture
def low_threshold(monkeypatch):
    """Buffers of 1 kB and more go through shared memory (the kernel's own cache, emptied after)."""
    from accel_magics.kernel_ext.wire.payload import SHARED

    monkeypatch.setenv("ACCEL_MAGICS_SHARE_THRESHOLD", "1024")
    monkeypatch.delenv("ACCEL_MAGICS_DISABLE", raising=False)
    yield
    SHARED.clear()


def test_the_reductions_shared_memory_relies_on_are_there():
    """The hook points: numpy hands pickle a contiguous array's memory as a
    PickleBuffer (protocol 5), and torch reduces a tensor to a TypedStorage
    that pickle meets as an object of its own.  Were either to move, big
    values would step aside for the plain pickle (exact, only slower)."""
    import pickle as std_pickle

    import numpy as np
    import torch

    reduced = np.zeros((3, 4), dtype=[("x", "f8"), ("y", "S4")]).__reduce_ex__(5)
    assert isinstance(reduced[1][0], std_pickle.PickleBuffer) and reduced[1][1].names == ("x", "y")
    storage = torch.zeros(4).__reduce_ex__(5)[1][0]
    assert type(storage) is torch.storage.TypedStorage and storage.dtype == torch.float32
    from accel_magics.kernel_ext.wire.payload import shared_globals_unsupported
    assert shared_globals_unsupported() is None   # the hook's guard checks both


def test_sending_a_value_never_changes_the_kernels_object(low_threshold):
    """Issue 44: ``.numpy()`` on the way to shared memory made torch mark the
    storage not resizable for ever, and the cache's weak reference made numpy
    refuse ``resize(..., refcheck=False)``."""
    import weakref as std_weakref

    import numpy as np
    import torch

    tensor, array, frozen = torch.zeros(10_000), np.zeros(10_000), np.arange(1000.0)
    frozen.flags.writeable = False
    ns = {"tensor": tensor, "array": array, "frozen": frozen}
    payload = build_payload("tensor, array, frozen", ns)
    assert len(payload.shared.refs) == 3
    loaded = {}
    payload.load_into(loaded)
    assert not loaded["frozen"].flags.writeable and loaded["array"].flags.writeable
    payload.release()
    assert tensor.untyped_storage().resizable() and std_weakref.getweakrefcount(array) == 0
    assert not frozen.flags.writeable
    tensor.resize_(20_000)
    tensor[10_000:] = 0   # resize_ leaves the new elements uninitialised
    tensor.add_(1)
    array.resize(20_000, refcheck=False)
    assert float(tensor[-1]) == 1.0 and array.shape == (20_000,)


def test_shared_globals_can_be_turned_off_by_name(low_threshold, monkeypatch):
    import numpy as np

    from accel_magics.kernel_ext import hooks

    ns = {"array": np.ones(10_000)}
    assert build_payload("array", ns).shared is not None
    monkeypatch.setenv("ACCEL_MAGICS_DISABLE", "shared_globals")
    payload = build_payload("array", ns)
    assert payload.shared is None and len(payload.globals_blob) > ns["array"].nbytes
    assert hooks.state("shared_globals") is hooks.HookState.DISABLED
    loaded = {}
    payload.load_into(loaded)
    assert (loaded["array"] == 1).all()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_big_value_that_goes_by_pickle_says_why_once(low_threshold, monkeypatch, caplog):
    import logging

    import numpy as np
    import torch

    from accel_magics.kernel_ext import hooks

    class Sub(np.ndarray):
        pass

    monkeypatch.setattr(hooks, "_asides", set())
    ns = {"q": torch.quantize_per_tensor(torch.randn(10_000), 0.1, 3, torch.qint8),
          "strided": np.arange(10_000.0)[::2], "sub": np.zeros(1000).view(Sub), "plain": np.zeros(1000),
          "small": torch.quantize_per_tensor(torch.randn(10), 0.1, 3, torch.qint8)}
    with caplog.at_level(logging.INFO, logger="accel_magics.hooks"):
        for _ in range(2):
            build_payload("q, strided, sub, plain, small", ns).release()
    asides = sorted(r.getMessage().split("hook shared_globals stepped aside: ", 1)[1]
                    for r in caplog.records if "stepped aside" in r.getMessage())
    assert len(asides) == 3, asides
    assert asides[0] == "a non-contiguous ndarray (numpy pickles a copy of its elements)"
    assert asides[1] == "quantized dtype qint8"
    assert asides[2].endswith("<locals>.Sub, an ndarray subclass (numpy pickles it with its data in the pickle)")


def test_the_threshold_comes_from_the_environment():
    from accel_magics.kernel_ext.wire.payload import SHARE_THRESHOLD, share_threshold

    assert share_threshold({}) == SHARE_THRESHOLD == 8 << 20
    assert share_threshold({"ACCEL_MAGICS_SHARE_THRESHOLD": "4096"}) == 4096
    assert share_threshold({"ACCEL_MAGICS_SHARE_THRESHOLD": "0"}) == 1   # an empty buffer never
    with pytest.raises(PayloadError, match="ACCEL_MAGICS_SHARE_THRESHOLD='8MB' is not a number of bytes"):
        share_threshold({"ACCEL_MAGICS_SHARE_THRESHOLD": "8MB"})


def test_a_kept_buffer_goes_after_payloads_that_do_not_use_it_or_with_its_storage(low_threshold):
    """An array's entry (no weak reference: numpy would refuse to resize it)
    is kept for the payloads after the last that used it; a tensor's goes
    with its storage."""
    import numpy as np
    import torch

    from accel_magics.kernel_ext.wire.payload import SHARED

    array, tensor = np.ones(10_000), torch.ones(10_000)
    build_payload("array, tensor", {"array": array, "tensor": tensor}).release()
    assert len(SHARED) == 2
    del tensor
    assert len(SHARED) == 1
    for _ in range(SHARED.KEEP_PAYLOADS - 1):
        build_payload("x = 1", {}).release()
    assert len(SHARED) == 1
    build_payload("x = 1", {}).release()
    assert len(SHARED) == 0
