"""Values reach the ranks as cloudpickle delivers them (issue 44 item 4), in
real kernels with real ranks.

What every rank receives is compared with the kernel's own
``cloudpickle.loads(cloudpickle.dumps(values))``, through a canonical
description (type, dtype with its fields and metadata, shape, strides, flags,
Python attributes, bytes, and which values are one object or share memory).
Big buffers take the shared-memory path (``SharedArena``); the property
tests lower its threshold (``ACCEL_MAGICS_SHARE_THRESHOLD``) so that small
generated values take it too, beside values that stay in the pickle.

One difference is not described: a torch storage that came through shared
memory is not resizable in the rank (torch cannot grow memory it did not
allocate), where one unpickled from bytes is.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

pytestmark = pytest.mark.timeout(240)

# What the kernel runs first: how to build a value from a spec, and the
# canonical description that ranks and kernel compare.  Also run here, for
# the dtypes it finds this torch can pickle.
HELPERS = r'''
import ctypes, hashlib, os, warnings
import cloudpickle
import numpy as np
import torch

warnings.filterwarnings("ignore")   # TypedStorage, quantized and nested tensors say they are deprecated or beta


class Sub(np.ndarray):
    """An ndarray subclass with an attribute (numpy's reduction of it has no __dict__: pickle drops it)."""

    def __array_finalize__(self, obj):
        self.info = getattr(obj, "info", None)


class Tagged(torch.Tensor):
    """A Tensor subclass (torch's reduction keeps its class and __dict__)."""


def _round_trips(make) -> bool:
    try:
        cloudpickle.loads(cloudpickle.dumps(make()))
        return True
    except Exception:
        return False


NP_DTYPES = {
    "f8": np.dtype("f8"), "f4": np.dtype("f4"), "f2": np.dtype("f2"), ">f8": np.dtype(">f8"),
    "i1": np.dtype("i1"), "i8": np.dtype("i8"), "u2": np.dtype("u2"), "bool": np.dtype("?"),
    "c8": np.dtype("c8"), "c16": np.dtype("c16"), "S5": np.dtype("S5"), "U3": np.dtype("U3"), "V6": np.dtype("V6"),
    "datetime64[s]": np.dtype("M8[s]"), "datetime64[D]": np.dtype("M8[D]"), "timedelta64[ms]": np.dtype("m8[ms]"),
    "struct": np.dtype([("x", "f8"), ("y", "i4"), ("z", "S4")]),
    "struct aligned": np.dtype([("a", "u1"), ("b", "f8")], align=True),
    "struct nested": np.dtype([("p", [("q", "i2"), ("r", "f4")]), ("s", "u1", (3,)), ("t", "M8[us]")]),
    "metadata": np.dtype(np.float64, metadata={"unit": "m"}),
    "struct metadata": np.dtype([("x", np.dtype("f4", metadata={"unit": "s"})), ("y", "i2")],
                                metadata={"table": "t1"}),
    "object": np.dtype(object),
}
NP_VIEWS = ("C", "F", "slice", "step", "T", "permute", "broadcast")

TORCH_DTYPES = [name for name in ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
                                  "int64", "bool", "complex64", "complex128", "complex32", "uint16", "uint32",
                                  "float8_e4m3fn")
                if hasattr(torch, name) and _round_trips(lambda: torch.zeros(2, dtype=getattr(torch, name)))]
TORCH_KINDS = ("plain", "param", "tagged", "conj", "neg", "quantized", "quantized per channel",
               "sparse coo", "sparse csr", "sparse csc", "nested", "jagged")
TORCH_VIEWS = ("contiguous", "slice", "T", "step", "expand")


def _np_value(dtype, shape, view, readonly, sub, seed):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[dtype]
    if dt.hasobject:
        a = np.empty(shape, dtype=object)
        a.flat = [(seed, i) for i in range(a.size)]
    else:
        a = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)
    if view == "F":
        a = np.asfortranarray(a)
    elif view == "slice" and a.ndim and a.shape[0] > 1:
        a = a[1:]
    elif view == "step" and a.ndim:
        a = a[::2]
    elif view == "T":
        a = a.T
    elif view == "permute" and a.ndim == 3:
        a = a.transpose(1, 0, 2)
    elif view == "broadcast" and a.size:
        a = np.broadcast_to(a.reshape(-1)[:1], (3, 4))
    if sub:
        a = a.view(Sub)
        a.info = seed
    if readonly:
        a.flags.writeable = False
    return a


def _torch_view(x, view):
    if view == "slice" and x.numel() > 1:
        return x.reshape(-1)[1:]
    if view == "T" and x.dim() >= 2:
        return x.permute(*reversed(range(x.dim())))
    if view == "step" and x.dim():
        return x[::2]
    if view == "expand" and x.numel():
        return x.reshape(-1)[:1].expand(3, 5)
    return x


def _torch_value(kind, dtype, shape, view, grad, attrs, seed):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    if kind in ("conj", "neg"):
        dt = dt if dt.is_complex else torch.complex64
    pairs = torch.randn(tuple(shape) + (2,), generator=g, dtype=torch.float64) * 50
    x = torch.view_as_complex(pairs).to(dt) if dt.is_complex else pairs[..., 0].to(dt)
    x = _torch_view(x, view)
    dense = x.real.float() if x.is_complex() else x.float()
    if kind in ("quantized per channel", "sparse coo", "sparse csr", "sparse csc") and dense.numel() == 0:
        dense = torch.randn(2, 3, generator=g)
    if kind == "conj":
        x = x.conj()
    elif kind == "neg":
        x = x.conj().imag
    elif kind == "quantized":
        qdtype = (torch.qint8, torch.quint8, torch.qint32)[seed % 3]
        x = torch.quantize_per_tensor(dense, 0.05 + (seed % 7) / 10, seed % 5, qdtype)
    elif kind == "quantized per channel":
        dense = dense.reshape(dense.shape[0] if dense.dim() else 1, -1)
        scales = torch.rand(dense.shape[0], generator=g, dtype=torch.float64) + 0.05
        x = torch.quantize_per_channel(dense, scales, torch.zeros(dense.shape[0], dtype=torch.long), 0, torch.quint8)
    elif kind == "sparse coo":
        x = (dense * (torch.rand(dense.shape, generator=g) > 0.5)).reshape(dense.shape or (1,)).to_sparse()
        if seed % 2:   # uncoalesced: each entry twice
            x = torch.sparse_coo_tensor(torch.cat([x._indices()] * 2, 1), torch.cat([x._values()] * 2), x.shape)
    elif kind in ("sparse csr", "sparse csc"):
        matrix = (dense * (torch.rand(dense.shape, generator=g) > 0.5)).reshape(dense.shape[0] if dense.dim() else 1, -1)
        x = matrix.to_sparse_csr() if kind == "sparse csr" else matrix.to_sparse_csc()
    elif kind in ("nested", "jagged"):
        parts = [torch.randn(n + 1, generator=g) for n in (shape or (2,))]
        x = torch.nested.nested_tensor(parts, layout=torch.jagged if kind == "jagged" else torch.strided)
    elif kind == "param":
        x = torch.nn.Parameter(x.detach(), requires_grad=grad and (dt.is_floating_point or dt.is_complex))
    elif kind == "tagged":
        x = x.as_subclass(Tagged)
        x.tag = seed
    if kind in ("plain", "tagged") and grad and x.layout == torch.strided and (dt.is_floating_point or dt.is_complex) \
            and view != "expand":
        x.requires_grad_()
    if kind in ("plain", "param", "tagged") and attrs:
        x.note = ("note", seed)
    return x


def _view_of(v):
    """A value sharing memory with ``v`` (a view), or ``v`` itself."""
    if isinstance(v, np.ndarray):
        return v.T if v.ndim >= 2 else v[...]
    if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_nested and not v.is_quantized:
        d = v.detach()
        return d[1:] if d.dim() and d.shape[0] > 1 else d.view(d.shape)
    return v


def build_values(specs):
    values = []
    for spec in specs:
        if spec[0] == "np":
            values.append(_np_value(*spec[1:]))
        elif spec[0] == "torch":
            values.append(_torch_value(*spec[1:]))
        elif values:
            earlier = values[-1 - spec[1] % len(values)]
            values.append(earlier if spec[0] == "same" else _view_of(earlier))
        else:
            values.append(None)
    return values


def _type(v):
    return f"{type(v).__module__}.{type(v).__qualname__}"


def _dtype(dt):
    fields = tuple((name, _dtype(dt.fields[name][0]), dt.fields[name][1]) for name in dt.names) \
        if dt.names is not None else None
    sub = (_dtype(dt.subdtype[0]), dt.subdtype[1]) if dt.subdtype else None
    return (repr(dt), dt.str, dt.itemsize, dt.alignment, dt.isalignedstruct, repr(dt.metadata), fields, sub)


def _attrs(v):
    return tuple(sorted((k, repr(x)) for k, x in getattr(v, "__dict__", {}).items()))


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _elements(a) -> bytes:
    """An array's elements, field by field (a copy leaves an aligned struct's padding as it found it)."""
    if a.dtype.names is not None:
        return b"".join(_elements(a[name]) for name in a.dtype.names)
    return repr(a.tolist()).encode() if a.dtype.hasobject else a.tobytes()


def describe(v):
    if isinstance(v, np.ndarray):
        f = v.flags
        return ("ndarray", _type(v), _dtype(v.dtype), v.shape, v.strides,
                (f.c_contiguous, f.f_contiguous, f.writeable, f.aligned, f.owndata), _attrs(v), _digest(_elements(v)))
    if isinstance(v, torch.Tensor) and v.is_nested:   # no plain sizes; a jagged one's are symbols, new in each
        head = ("nested", _type(v), str(v.dtype), str(v.layout), v.requires_grad, v.is_leaf)
        if v.layout == torch.jagged:
            return head + (describe(v.values()), describe(v.offsets()), v._ragged_idx)
        return head + (_attrs(v), describe(v._nested_tensor_size()), describe(v._nested_tensor_strides()),
                       tuple(v._nested_tensor_storage_offsets()), tuple(describe(part) for part in v.unbind()))
    if isinstance(v, torch.Tensor):
        head = ("tensor", _type(v), str(v.dtype), str(v.layout), str(v.device), tuple(v.shape), v.requires_grad,
                v.is_leaf, _attrs(v))
        if v.layout == torch.sparse_coo:
            return head + (v.is_coalesced(), describe(v._indices()), describe(v._values()))
        if v.layout == torch.sparse_csr:
            return head + (describe(v.crow_indices()), describe(v.col_indices()), describe(v.values()))
        if v.layout == torch.sparse_csc:
            return head + (describe(v.ccol_indices()), describe(v.row_indices()), describe(v.values()))
        if v.is_quantized:
            params = (v.q_scale(), v.q_zero_point()) if v.qscheme() == torch.per_tensor_affine else \
                (describe(v.q_per_channel_scales()), describe(v.q_per_channel_zero_points()), v.q_per_channel_axis())
            return head + (str(v.qscheme()), params, v.stride(), v.storage_offset(), describe(v.int_repr()))
        storage = v.untyped_storage()
        return head + (v.stride(), v.storage_offset(), v.is_conj(), v.is_neg(), storage.nbytes(),
                       _digest(ctypes.string_at(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else b""))
    return ("other", _type(v), repr(v))


def _span(v):
    if isinstance(v, np.ndarray) and v.size and not v.dtype.hasobject:
        bounds = getattr(np, "byte_bounds", None) or np.lib.array_utils.byte_bounds
        return bounds(v)
    if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_nested:
        storage = v.untyped_storage()
        return (storage.data_ptr(), storage.data_ptr() + storage.nbytes()) if storage.nbytes() else None
    return None


def canon(values):
    """Each value described, and for each, the earlier values that are the
    same object and those whose memory overlaps its own."""
    spans = [_span(v) for v in values]
    same = [tuple(j for j in range(i) if values[j] is values[i]) for i in range(len(values))]
    overlap = [tuple(j for j in range(i) if spans[i] and spans[j] and spans[i][0] < spans[j][1]
                     and spans[j][0] < spans[i][1]) for i in range(len(values))]
    return [describe(v) for v in values], same, overlap


def round_trip(values):
    return canon(cloudpickle.loads(cloudpickle.dumps(values)))


def check_values(values, expected, specs):
    """In a rank: what it received against what cloudpickle gives the kernel."""
    got = canon(values)
    bad = [i for i, (g, e) in enumerate(zip(got[0], expected[0])) if g != e]
    if bad or got[1:] != expected[1:] or len(got[0]) != len(expected[0]):
        lines = [f"rank {os.environ.get('RANK')}: {len(bad)} of {len(values)} values differ from cloudpickle's"]
        for i in bad[:4]:
            lines += [f"  value {i}, {specs[i]!r}:", f"    got      {got[0][i]!r}", f"    expected {expected[0][i]!r}"]
        for what, at in (("same object", 1), ("shared memory", 2)):
            if got[at] != expected[at]:
                lines.append(f"  {what}: got {got[at]}, expected {expected[at]}")
        raise AssertionError("\n".join(lines))
    return f"ok {len(values)}"
'''

_local: dict = {}
exec(HELPERS, _local)

BATCH = 50            # values per cell
BATCHES = 10          # cells per run mode: 500 values each
THRESHOLD = 16        # bytes: most generated values (and parts of them) go through shared memory

seeds = st.integers(0, 2 ** 31 - 1)
shapes = st.lists(st.integers(0, 6), max_size=3).map(tuple)
np_specs = st.tuples(st.just("np"), st.sampled_from(sorted(_local["NP_DTYPES"])), shapes,
                     st.sampled_from(_local["NP_VIEWS"]), st.booleans(), st.booleans(), seeds)
torch_specs = st.tuples(st.just("torch"), st.sampled_from(_local["TORCH_KINDS"]), st.sampled_from(_local["TORCH_DTYPES"]),
                        shapes, st.sampled_from(_local["TORCH_VIEWS"]), st.booleans(), st.booleans(), seeds)
alias_specs = st.tuples(st.sampled_from(["same", "view"]), st.integers(0, 20))
batches = st.lists(st.one_of(np_specs, torch_specs, alias_specs), min_size=BATCH, max_size=BATCH)
PROPERTY = settings(max_examples=BATCHES, deadline=None, database=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def kernel():
    from conftest import LoadedKernel

    k = LoadedKernel()
    k.ok(HELPERS)
    try:
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def low_threshold(kernel):
    """The kernel shares buffers of THRESHOLD bytes and more, for one test."""
    kernel.ok(f"os.environ['ACCEL_MAGICS_SHARE_THRESHOLD'] = '{THRESHOLD}'")
    yield kernel
    kernel.ok("os.environ.pop('ACCEL_MAGICS_SHARE_THRESHOLD', None)")


def _set_batch(k, specs) -> None:
    k.ok(f"specs = {specs!r}\nvalues = build_values(specs)\nexpected = round_trip(values)")


def _shared_buffers(k) -> int:
    """How many buffers the last %%distributed cell sent through shared memory (kept for the next cells)."""
    return int(k.ok("from accel_magics.kernel_ext.wire.payload import SHARED\n"
                    "sum(entry[3] == SHARED.payloads for entry in SHARED._entries.values())").result)


def _enough(sent: list) -> None:
    """500 values or more went, and shared memory carried some of them in most cells."""
    assert sum(n for n, _ in sent) >= BATCH * BATCHES, sent
    assert sum(1 for _, shared in sent if shared) >= len(sent) // 2, sent


def _said_ok(res) -> None:
    for rank in (0, 1):
        assert f"[rank {rank}] ok {BATCH}" in res.stdout, res.error_text + res.stdout + res.stderr


CHECK = "print(check_values(values, expected, specs))"


def _every_batch(k, send) -> None:
    """``send(specs)`` for each generated batch (it sets the batch in the kernel
    and checks it on the ranks), then: enough values went, shared memory too."""
    sent = []

    @PROPERTY
    @given(batches)
    def one_batch(specs):
        send(specs)
        sent.append((len(specs), _shared_buffers(k)))

    one_batch()
    _enough(sent)


def test_generated_values_arrive_as_cloudpickle_gives_them_in_one_shot_cells(low_threshold):
    k = low_threshold

    def send(specs):
        _set_batch(k, specs)
        _said_ok(k.run(f"%%distributed -n 2 --output text\n{CHECK}", timeout=120))

    _every_batch(k, send)


def test_generated_values_arrive_as_cloudpickle_gives_them_in_background_runs(low_threshold):
    k = low_threshold

    def send(specs):
        _set_batch(k, specs)
        k.ok(f"%%distributed -n 2 --background --output text\ncheck_values(values, expected, specs)")
        k.ok("handle = _")
        res = k.run("handle.wait()", timeout=120)
        assert res.status == "ok" and res.result == f"'ok {BATCH}'", res.error_text

    _every_batch(k, send)


@pytest.fixture
def session(low_threshold):
    k = low_threshold
    k.ok("%distributed_session start -n 2")
    yield k
    k.run("%distributed_session stop", timeout=60)


def test_generated_values_arrive_as_cloudpickle_gives_them_in_session_cells(session):
    k = session

    def send(specs):
        _set_batch(k, specs)
        _said_ok(k.run(f"%%distributed --session --output text\n{CHECK}", timeout=120))

    _every_batch(k, send)


def test_generated_values_arrive_as_cloudpickle_gives_them_by_push(session):
    """The session owns ``values`` (a session cell bound it); the notebook's
    replaces it by ``%distributed_session push``."""
    k = session

    def send(specs):
        res = k.run("%%distributed --session --output text\nvalues = expected = specs = None", timeout=60)
        assert res.status == "ok", res.error_text
        _set_batch(k, specs)
        k.ok("%distributed_session push values expected specs")
        _said_ok(k.run(f"%%distributed --session --output text\n{CHECK}", timeout=120))

    _every_batch(k, send)


# -- the values of issue 44, at their real sizes (the default threshold, 8 MB) -----------

NAMED = {
    "structured array": "np.zeros(800_000, dtype=[('x', 'f8'), ('y', 'i4'), ('z', 'S4')])",
    "dtype metadata": "np.arange(2_000_000, dtype=np.dtype(np.float64, metadata={'unit': 'm'}))",
    "read-only array": "np.frombuffer(np.arange(2_000_000, dtype='f8').tobytes(), 'f8')",
    "datetime64": "np.arange(2_000_000).astype('datetime64[s]')",
    "timedelta64": "np.arange(2_000_000).astype('timedelta64[ms]')",
    "Fortran order": "np.asfortranarray(np.arange(2_000_000, dtype='f8').reshape(1000, 2000))",
    "tensor attribute": "_with_note(torch.arange(4_000_000, dtype=torch.float32))",
    "tensor view": "torch.arange(4_000_000, dtype=torch.float32).reshape(2000, 2000)[10:, ::3]",
    "Parameter": "torch.nn.Parameter(torch.ones(4_000_000))",
    "quantized": "torch.quantize_per_tensor(torch.randn(9_000_000), 0.1, 3, torch.qint8)",
    "conjugate bit": "torch.randn(2_000_000, dtype=torch.complex64).conj()",
    "negative bit": "torch._neg_view(torch.randn(4_000_000))",
    "sparse CSR": "torch.eye(3000).to_sparse_csr()",
    "sparse CSC": "torch.eye(3000).to_sparse_csc()",
    "nested": "torch.nested.nested_tensor([torch.randn(3_000_000), torch.randn(1_000_000)])",
}


def _named(k, what: str) -> None:
    k.ok("def _with_note(t):\n    t.note = {'unit': 'm'}\n    return t\n"
         f"values = [{NAMED[what]}]\nspecs = [{what!r}]\nexpected = round_trip(values)")


@pytest.mark.parametrize("what", sorted(NAMED))
def test_each_value_named_in_issue_44_arrives_as_cloudpickle_gives_it(kernel, what):
    """On main these arrived changed (structured as |V16, metadata, the
    read-only flag and attributes dropped), were refused (datetime64,
    conj/neg bits, sparse CSR/CSC, nested) or killed the ranks (quantized)."""
    _named(kernel, what)
    res = kernel.run(f"%%distributed -n 2 --output text\n{CHECK}", timeout=120)
    for rank in (0, 1):
        assert f"[rank {rank}] ok 1" in res.stdout, res.error_text + res.stdout + res.stderr


@pytest.mark.parametrize("mode", ["background", "session", "push"])
def test_a_big_structured_array_keeps_its_fields_in_every_run_mode(kernel, mode):
    k = kernel
    if mode == "background":
        _named(k, "structured array")
        k.ok(f"%%distributed -n 2 --background --output text\ncheck_values(values, expected, specs)")
        k.ok("handle = _")
        res = k.run("handle.wait()", timeout=120)
        assert res.status == "ok" and res.result == "'ok 1'", res.error_text
        return
    k.ok("%distributed_session start -n 2")
    try:
        if mode == "push":
            assert k.run("%%distributed --session --output text\nvalues = None").status == "ok"
            _named(k, "structured array")
            k.ok("%distributed_session push values")
        else:
            _named(k, "structured array")
        res = k.run(f"%%distributed --session --output text\n{CHECK}", timeout=120)
        for rank in (0, 1):
            assert f"[rank {rank}] ok 1" in res.stdout, res.error_text + res.stdout + res.stderr
    finally:
        k.run("%distributed_session stop", timeout=60)


def test_the_kernel_can_resize_what_a_cell_used_and_lives_on(kernel):
    """Issue 44: ``.numpy()`` on the way to shared memory made torch mark the
    notebook's storage not resizable for ever (``resize_`` raised, and the
    next ``add_`` killed the kernel), and the cache's weak reference made
    numpy refuse ``resize(..., refcheck=False)``."""
    k = kernel
    k.ok("tt = torch.zeros(5_000_000)\narr = np.zeros(2_000_000)")
    res = k.run("%%distributed -n 2 --output text\nprint('sums', float(tt.sum()), float(arr.sum()))", timeout=120)
    assert "[rank 1] sums 0.0 0.0" in res.stdout, res.error_text + res.stdout
    res = k.run("tt.resize_(6_000_000)\ntt[5_000_000:] = 0\ntt.add_(1)\narr.resize(3_000_000, refcheck=False)\narr += 1\n"
                "float(tt[-1]), float(arr[-1]), tt.untyped_storage().resizable()", timeout=60)
    assert res.status == "ok", res.error_text
    assert res.result == "(1.0, 1.0, True)"
    res = k.run("%%distributed -n 2 --output text\nprint('sums', float(tt.sum()), float(arr.sum()))", timeout=120)
    assert "[rank 0] sums 6000000.0 3000000.0" in res.stdout, res.error_text + res.stdout
    assert k.ok("2 + 2").result == "4"
    k.ok("del tt, arr")


def test_return_values_come_back_as_cloudpickle_gives_them(kernel):
    """``--return``: rank 0's values, described as cloudpickle gives them in
    the rank, against what reached the kernel."""
    k = kernel
    made = ", ".join(NAMED[w] for w in sorted(NAMED))
    res = k.run("%%distributed -n 2 --output text --return back,sent\n"
                f"def _with_note(t):\n    t.note = {{'unit': 'm'}}\n    return t\nback = [{made}]\n"
                "sent = round_trip(back)", timeout=120)
    assert res.status == "ok", res.error_text + res.stdout
    assert k.ok("canon(back) == sent").result == "True"


def test_del_of_a_big_array_frees_its_shared_copy_at_that_cells_end(kernel):
    """A numpy array's shared copy is kept for the next cells without a weak
    reference (numpy would refuse to resize the array); the kernel lets it go
    once no array of the notebook shows that memory: ``del big`` frees it then,
    not cells later.  One held in a list stays."""
    from cases import memfds

    k = kernel
    k.ok("big = np.ones(2_000_000)\nheld = [np.ones(2_000_000)]")
    res = k.run("%%distributed -n 2 --output text\nprint('sums', float(big.sum()), float(held[0].sum()))", timeout=120)
    assert "[rank 1] sums 2000000.0 2000000.0" in res.stdout, res.error_text + res.stdout
    assert memfds(k.pid) == 2
    k.ok("del big")
    assert memfds(k.pid) == 1
    k.ok("del held")
    assert memfds(k.pid) == 0
