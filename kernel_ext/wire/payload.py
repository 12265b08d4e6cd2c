"""Turn a cell's source and the kernel's namespace into a payload for the ranks.

The payload is the source (compiled on each rank) plus the kernel globals the
source references, cloudpickled once: functions and classes defined in the
notebook travel by value, modules by reference.  Everything that can be
checked before launch is checked here, so a mistake costs no processes:
syntax errors, names defined nowhere, values that cannot be shipped.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import fcntl
import functools
import itertools
import mmap
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
import marshal
import types
import weakref
from typing import Callable, Optional

import cloudpickle

from .. import hooks
from ..environment import cpu_count
from ..sigint import sigint_deferred



def cache_source(filename: str, text: str) -> None:
    """A notebook cell's source in ``linecache`` as ``filename`` ("Cell In[3]":
    tracebacks, pdb's ``l``) and as pdb names it (its absolute path from the
    working directory, since it has no angle brackets): ``b 7`` then finds the line."""
    import linecache

    entry = (len(text), None, text.splitlines(True), filename)
    linecache.cache[filename] = entry
    linecache.cache[os.path.abspath(filename)] = entry

class PayloadError(Exception):
    """The cell cannot be shipped; the message says which name and what to do."""


@dataclass
class Payload:
    source: str                  # the cell as the ranks compile it
    filename: str                # shown in the ranks' tracebacks
    globals_blob: bytes          # cloudpickled {name: value}
    shipped_names: list[str]
    return_names: list[str] = field(default_factory=list)
    sys_path: list[str] = field(default_factory=list)
    cwd: str = ""
    shared: Optional["SharedArena"] = None   # big buffers (pickle's out-of-band ones), through shared memory
    sources: dict = field(default_factory=dict)   # notebook cells' source by label ("Cell In[2]")

    def load_into(self, namespace: dict) -> set:
        """In a rank: put the shipped globals into ``namespace`` (the rank's
        ``__main__``, already in ``sys.modules``), with every notebook
        definition the shipped code can reach, and the source of notebook
        cells into linecache, so tracebacks show the cell and its line.
        Returns the names it set."""
        import linecache

        refs = self.shared.refs if self.shared is not None else []
        loaded = cloudpickle.loads(self.globals_blob, buffers=map(_map_shared, refs))
        if not (isinstance(loaded, tuple) and len(loaded) == 3):   # a plain {name: value} blob
            namespace.update(loaded)
            return set(loaded)
        shipped, definitions, sources = loaded
        for filename, text in sources.items():
            cache_source(filename, text)
        namespace.update(definitions)
        namespace.update(shipped)
        return set(definitions) | set(shipped)

    def release(self) -> None:
        """Free the shared memory of big globals (after the run)."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None


def parse(source: str, filename: str) -> ast.Module:
    """Parse and compile the cell, raising SyntaxError with the cell's own line
    numbers.  Compiling (not only parsing) catches what only the compiler
    rejects ('await' or 'return' outside a function) before any rank starts."""
    tree = ast.parse(source, filename=filename, mode="exec")
    compile(tree, filename, "exec", dont_inherit=True)
    return tree


class NameCollector(ast.NodeVisitor):
    """Names the cell reads and names it binds."""

    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.top_level_loaded: set[str] = set()
        self.bound: set[str] = set()
        self.star_import = False
        self._depth = 0  # > 0 inside function bodies (executed later, maybe never)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.loaded.add(node.id)
            if self._depth == 0:
                self.top_level_loaded.add(node.id)
        else:
            self.bound.add(node.id)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):   # ``x += 1`` reads x first
            self.loaded.add(node.target.id)
            if self._depth == 0:
                self.top_level_loaded.add(node.target.id)
        self.generic_visit(node)

    def _function(self, node) -> None:
        self.bound.add(node.name)
        for deco in node.decorator_list:
            self.visit(deco)
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for arg in ast.walk(node.args):
            if isinstance(arg, ast.arg):
                self.bound.add(arg.arg)
                if arg.annotation is not None:
                    self.visit(arg.annotation)
        if node.returns is not None:
            self.visit(node.returns)
        self._depth += 1
        for stmt in node.body:
            self.visit(stmt)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for arg in ast.walk(node.args):
            if isinstance(arg, ast.arg):
                self.bound.add(arg.arg)
        self._depth += 1
        self.visit(node.body)
        self._depth -= 1

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.bound.add((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name == "*":
                self.star_import = True
            else:
                self.bound.add(alias.asname or alias.name)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        self.loaded.update(node.names)

    def visit_MatchAs(self, node) -> None:  # pragma: no cover - 3.10+ syntax
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node) -> None:  # pragma: no cover
        if node.name:
            self.bound.add(node.name)

    def visit_MatchMapping(self, node) -> None:  # pragma: no cover
        if node.rest:
            self.bound.add(node.rest)
        self.generic_visit(node)


def own_names(tree: ast.Module) -> set[str]:
    """Names the cell binds, unconditionally, before it reads them: the cell's
    own, never the kernel's (``log = open(...)`` in the cell shadows the
    kernel's ``log``).  Statements run in order: a top-level assignment,
    import, ``def``, ``class`` or ``with ... as`` binds its names (not the ``with``
    body: the context manager may suppress an exception); loads
    anywhere in a statement (function bodies included: they may run at once)
    count before the statement's own bindings, and a name read first is
    the kernel's.  Branches and loops bind nothing here (they may not run)."""
    own: set[str] = set()
    read: set[str] = set()

    def loads_in(node) -> set[str]:
        collector = NameCollector()
        collector.visit(node)
        return collector.loaded

    def bound_by(target) -> list[str]:
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, (ast.Tuple, ast.List)):
            return [n for elt in target.elts for n in bound_by(elt)]
        if isinstance(target, ast.Starred):
            return bound_by(target.value)
        return []

    def bind(new: list[str]) -> None:
        own.update(n for n in new if n not in read)

    def walk(body: list) -> None:
        for stmt in body:
            if isinstance(stmt, ast.With):
                # ``as`` names are bound; the body is conditional: a context
                # manager may suppress an exception (contextlib.suppress).
                for item in stmt.items:
                    read.update(loads_in(item.context_expr) - own)
                    if item.optional_vars is not None:
                        read.update(loads_in(item.optional_vars) - own)
                        bind(bound_by(item.optional_vars))
                for inner in stmt.body:
                    read.update(loads_in(inner) - own)
                continue
            read.update(loads_in(stmt) - own)
            if isinstance(stmt, ast.Assign):
                bind([n for target in stmt.targets for n in bound_by(target)])
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                bind(bound_by(stmt.target))
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                bind([(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"])
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind([stmt.name])

    walk(tree.body)
    return own


def _describe(value) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def build_payload(
    source: str,
    namespace: dict,
    *,
    filename: str = "<distributed cell>",
    exclude: set | frozenset = frozenset(),
    return_names: list[str] | None = None,
    code_label: Optional[Callable[[str], Optional[str]]] = None,
    defined: set | frozenset = frozenset(),
    share: bool = True,
) -> Payload:
    """Check the cell and ship the globals it references.

    ``exclude`` holds names that belong to the frontend (IPython's ``In``,
    ``Out``, ``get_ipython``...) and must never travel.  ``code_label`` names
    the notebook cell a code object's filename belongs to (IPython's
    ``Cell In[2]``), or None for code that is not a cell's.
    """
    tree = parse(source, filename)
    names = NameCollector()
    names.visit(tree)
    own = own_names(tree)

    builtin_names = set(dir(builtins))
    wanted = sorted(n for n in names.loaded if n in namespace and n not in exclude and n not in own
                    and n not in defined)
    if not names.star_import:
        undefined = sorted(
            n
            for n in names.top_level_loaded
            if n not in namespace and n not in names.bound and n not in builtin_names and n not in defined
        )
        if undefined:
            listed = ", ".join(f"'{n}'" for n in undefined)
            raise PayloadError(
                f"name {listed} is not defined: not in this cell and not in the notebook. "
                "Define it in an earlier cell (run that cell first) or inside this %%distributed cell."
            )

    shipped = {n: namespace[n] for n in wanted}
    arena = SharedArena()
    arena.threshold = share_threshold()
    arena.enabled = bool(share and shipped) and hooks.install(   # nothing shipped: nothing to share
        "shared_globals", lambda: f"buffers of {arena.threshold} bytes and more", guard=shared_globals_unsupported)
    if share and (arena.enabled or not shipped):   # a payload that ships nothing still ages the kept buffers
        arena.cache.next_payload()
    with _noting_interrupts() as interrupts:
        try:
            blob, sources = _dumps(shipped, arena, namespace, code_label, keep_out=defined)
        except BaseException as exc:
            arena.close()   # whatever happened, the shared memory of big globals is freed now
            if isinstance(exc, KeyboardInterrupt) and interrupts.seen:
                # The user's interrupt (the stop button): not a pickling problem.  Its
                # traceback (IPython keeps the last one) must not keep the cell's
                # values alive in the pickler's frames, nor their kept shared memory.
                traceback.clear_frames(exc.__traceback__)
                shipped.clear()   # this frame's own (an executing frame is not cleared)
                raise
            _raise_for_unpicklable(shipped, interrupts)
            raise PayloadError(f"the cell's variables could not be sent to the ranks: "
                               f"{_exc_text(exc)}") from None
    if not arena.used:
        arena.close()
        arena = None
    return Payload(
        source=source,
        filename=filename,
        globals_blob=blob,
        shipped_names=wanted,
        return_names=list(return_names or []),
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        shared=arena,
        sources=sources,
    )


# -- big buffers through shared memory ------------------------------------------------

SHARE_THRESHOLD = 8 * 1024 * 1024   # bytes: smaller buffers travel inside the pickle
THRESHOLD_ENV = "ACCEL_MAGICS_SHARE_THRESHOLD"


def share_threshold(environ=None) -> int:
    """The size from which a buffer goes through shared memory: the kernel's
    ``ACCEL_MAGICS_SHARE_THRESHOLD`` (bytes), read at each cell (tests lower
    it so that small values take this path), else :data:`SHARE_THRESHOLD`."""
    text = (os.environ if environ is None else environ).get(THRESHOLD_ENV, "").strip()
    if not text:
        return SHARE_THRESHOLD
    try:
        return max(1, int(text))   # an empty buffer never: there is nothing to map
    except ValueError:
        raise PayloadError(f"{THRESHOLD_ENV}={text!r} is not a number of bytes "
                           f"(the default is {SHARE_THRESHOLD}).") from None


def shared_globals_unsupported() -> Optional[str]:
    """Why the kernel cannot share memory with its ranks here, or None: the
    platform's memfds, and the hook points, numpy's reduction of an array
    to a ``PickleBuffer`` and torch's of a tensor to a ``TypedStorage``
    (each once the kernel has imported it: neither is imported for this)."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is missing (Linux only)"
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return "no /proc/<pid>/fd: the ranks could not open the kernel's memory"
    if not _numpy_found():
        return "numpy is not installed (kept memory is compared through it)"
    return _reductions_unsupported("numpy" in sys.modules, "torch" in sys.modules)


_numpy_seen = False   # found once: it stays installed (one not found is looked for again)


def _numpy_found() -> bool:
    """Is numpy importable?  Not imported for this; looked up on disk until found once."""
    global _numpy_seen
    if not _numpy_seen:
        import importlib.util

        _numpy_seen = "numpy" in sys.modules or importlib.util.find_spec("numpy") is not None
    return _numpy_seen


@functools.lru_cache(maxsize=None)
def _reductions_unsupported(with_numpy: bool, with_torch: bool) -> Optional[str]:
    if with_numpy:
        import numpy as np

        reduced = np.zeros(2).__reduce_ex__(5)
        if not (len(reduced) > 1 and reduced[1] and isinstance(reduced[1][0], pickle.PickleBuffer)):
            return f"numpy {np.__version__} no longer reduces an array to a PickleBuffer"
    if with_torch:
        import torch

        reduced = torch.zeros(2).__reduce_ex__(5)
        if not (len(reduced) > 1 and reduced[1] and type(reduced[1][0]) is torch.storage.TypedStorage):
            return f"torch {torch.__version__} no longer reduces a tensor to a TypedStorage"
    return None


class SharedArena:
    """The shared memory of one payload's big buffers: one memfd per buffer,
    written by the kernel, mapped copy-on-write by the ranks.

    The buffers are pickle's own out-of-band buffers (protocol 5): what a
    value's reduction hands pickle as a ``PickleBuffer`` (a numpy array does,
    with its whole dtype; a torch storage does in :class:`_SharingPickler`)
    of :attr:`threshold` bytes and more.  All the rest of the value is in the
    pickle as cloudpickle writes it, and the ranks' ``pickle.loads`` gets the
    buffers back in their order (:meth:`Payload.load_into`): each value is
    rebuilt by its own code, as from an in-band pickle, read-only where the
    original was (pickle's ``READONLY_BUFFER``).

    Ranks map each buffer ``MAP_PRIVATE`` through ``/proc/<kernel pid>/fd/<fd>``:
    no copy per rank, and a rank that writes to its array changes only its
    own pages, as after notebook_launcher's fork.  The memfds come from
    :data:`SHARED` (kept across cells while the memory is unchanged, or can
    be updated in place); the arena holds its own descriptor of each, with a
    shared lock, until the run is over (:meth:`close`), so nothing the cache
    does meanwhile can pull one from under a rank that has not mapped it
    yet, nor write into it.
    """

    enabled = True   # False: ranks on other machines, or the hook turned off (everything is pickled)
    threshold = SHARE_THRESHOLD
    open_arenas: "weakref.WeakSet[SharedArena]" = weakref.WeakSet()   # holding descriptors now

    def __init__(self, cache: Optional["SharedCache"] = None) -> None:
        self.cache = cache if cache is not None else SHARED
        self.fds: list[int] = []
        self.refs: list[tuple] = []   # per out-of-band buffer, in pickle's order: (kernel pid, fd, offset, nbytes)
        self.size = 0

    @property
    def used(self) -> bool:
        return self.size > 0

    def add(self, view: memoryview, key: tuple, token=None) -> None:
        """``view`` (bytes of the kernel's) becomes the next out-of-band
        buffer.  ``key``: its (address, size), as the cache knows it;
        ``token``: an object that lives exactly as long as that memory, or None."""
        SharedArena.open_arenas.add(self)
        fd = self.cache.hold(key, view, into=self.fds, token=token)   # in self.fds before an interrupt can land
        self.size += view.nbytes
        self.refs.append((os.getpid(), fd, 0, view.nbytes))

    def close(self) -> None:
        fds, self.fds = self.fds, []
        SharedArena.open_arenas.discard(self)
        for fd in fds:
            os.close(fd)

    __del__ = close   # a payload dropped without release() still lets its memory go

    def __getstate__(self) -> dict:
        # The fds are the kernel's: a copy unpickled in another process (a
        # supervisor, a session's rank) must never close those numbers there.
        return {"fds": [], "refs": list(self.refs), "size": self.size, "cache": None}


@functools.lru_cache(maxsize=None)
def _memcmp():
    """libc's ``memcmp`` through ctypes (which lets the GIL go around it)."""
    import ctypes

    memcmp = ctypes.CDLL(None).memcmp
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    return memcmp


def _address(view) -> int:
    import numpy as np

    return np.frombuffer(view, np.uint8).ctypes.data


@functools.lru_cache(maxsize=None)
def _memoryview_from_memory():
    import ctypes

    from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
    from_memory.restype = ctypes.py_object
    from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    return from_memory


def _memory_at(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``address`` (no ctypes array
    type per size: ctypes keeps every one it makes).  It does not keep the
    memory alive: the caller holds its owner."""
    return _memoryview_from_memory()(address, nbytes, 0x200)   # PyBUF_WRITE


class SharedCache:
    """Big buffers already in shared memory, kept across cells (issue 27
    item 2): a 1 GB global used by cell after cell was written into fresh
    shared memory for every cell, 0.7x the data in extra memory each time.

    Keyed by the memory's address and size, and kept while one of the last
    :attr:`KEEP_PAYLOADS` payloads used it (an entry unused in this payload
    gives way, the longest unused first, when a new buffer needs room in the
    budget).  A torch storage's entry also goes as soon as the storage does:
    a weak reference to its Python object (torch keeps that object for as
    long as the storage lives; a weak reference changes nothing torch does).
    A numpy array gets none: numpy refuses to resize an array that has a
    weak reference, ``refcheck=False`` or not, so the notebook's own array
    would change.  An entry is reused only when its bytes are *exactly* the
    memory's: a full comparison, no version
    counter or sampled checksum that a write through ``.data``, ``.numpy()``
    or a C extension could get past (nor an array freed and another made at
    its address); comparing reads at memory speed, several times faster than
    writing fresh pages.

    A changed buffer's memfd is brought up to date in place (only the chunks
    that differ are written: ``big[0] += 1`` costs a comparison, not 512 MB
    of fresh pages) when nobody can see it change.  Who can is told by
    ``flock``: every run's arena and every process that maps the memfd (a
    rank, the workers it forks, a session's rank that keeps the value) holds
    a shared lock on it, on an open file of its own, released when that
    process exits or its mapping goes.  The kernel writes only under an
    exclusive lock taken without waiting; while anyone holds a shared one
    (a background run, a session's value, ranks still exiting) the changed
    buffer gets a new memfd, and they keep the values they were sent.
    """

    CHUNK = 16 << 20          # bytes compared at a time (between two, a stop is let through)
    COMPARE_THREADS = 4       # at most this many threads compare (memory bandwidth, not cores, is the limit)
    WRITE_CHUNK = 128 << 20   # bytes written by one pwrite (between two, a stop is let through)
    KEEP_PAYLOADS = 4         # an entry is kept while one of the last this many payloads used it

    def __init__(self, budget: Optional[int] = None) -> None:
        # Kept memory stays taken between cells: at most a quarter of the
        # machine's (beyond it a buffer's shared memory is its run's only, as before).
        self.budget = budget if budget is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        self._lock = threading.RLock()   # a weak reference's callback may run inside hold() (a GC there)
        # (address, nbytes) -> [weak reference to the token or None, memfd, its mapping, payload that used it last]
        self._entries: dict[tuple, list] = {}
        self.payloads = 0

    def next_payload(self) -> None:
        """A payload begins: entries that none of the last
        :attr:`KEEP_PAYLOADS` payloads used go now."""
        with self._lock:
            self.payloads += 1
            stale = [key for key, entry in self._entries.items() if entry[3] <= self.payloads - self.KEEP_PAYLOADS]
        for key in stale:
            self._drop(key)

    def hold(self, key: tuple, view: memoryview, into: list, token=None) -> int:
        """A descriptor of a memfd holding ``view``'s bytes, appended to
        ``into`` (the caller's, to close): the memfd kept under ``key``,
        brought up to date if it can be, else a new one, kept from now on,
        each with a shared lock on it (see the class).  Past the budget a new
        memfd that is this run's alone: the caller's own descriptor, kept
        nowhere, so never written again and unlocked.

        The kernel's interrupt (the stop button) is held while descriptors
        change hands and let through between chunks of the long comparisons
        and writes: every descriptor opened here is in ``into`` or in the
        cache whenever it can land, so an interrupted cell leaks none (one
        left open, with its lock, would also have kept its memfd from ever
        being updated in place again)."""
        with sigint_deferred() as held:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and len(entry[2]) == view.nbytes \
                        and self._up_to_date(key[0], view, entry[1], entry[2], held):
                    entry[3] = self.payloads
                    into.append(self._lease(entry[1]))
                    return into[-1]
            if entry is not None:
                # Changed and still seen: the kernel lets its memfd go (it lives
                # on while someone maps it; then old and new both take memory,
                # as two values do) and writes a new one.
                self._drop(key)
            self._make_room(view.nbytes)   # before the write: what gives way is freed first
            fd, mapping = self._write(view, held)
            try:
                if self.kept_bytes() + view.nbytes > self.budget:
                    raise TypeError("over the budget")
                ref = None if token is None else weakref.ref(token, lambda ref, key=key: self._drop(key, ref))
            except TypeError:   # too much kept already (or a token without weak references): this run's alone
                mapping.close()
                into.append(fd)
                return fd
            with self._lock:
                old, self._entries[key] = self._entries.get(key), [ref, fd, mapping, self.payloads]
                into.append(self._lease(fd))
            if old is not None:   # another thread's meanwhile
                self._release(old)
            return into[-1]

    def _make_room(self, nbytes: int) -> None:
        """Entries that this payload has not used go, the longest unused
        first, until ``nbytes`` more fit in the budget."""
        with self._lock:
            spare = sorted((entry[3], key) for key, entry in self._entries.items() if entry[3] < self.payloads)
        for _, key in spare:
            if self.kept_bytes() + nbytes <= self.budget:
                return
            self._drop(key)

    @staticmethod
    def _lease(fd: int) -> int:
        """A new open file of the memfd (``/proc/self/fd``: its own lock
        owner, unlike a ``dup``) holding a shared lock, for a run's arena."""
        leased = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(leased, fcntl.LOCK_SH)
        return leased

    def _write(self, view: memoryview, held) -> tuple:
        fd = os.memfd_create("accel_magics-globals", os.MFD_CLOEXEC)
        try:
            # pwrite, not a copy into a mapping: one page fault per 4 kB page
            # made 1 GB take 5 s; the read-only mapping (for later comparisons)
            # is populated by the kernel in one go.  In chunks: a stop
            # between two is let through at once (the first write of 1 GB
            # takes seconds).
            os.ftruncate(fd, view.nbytes)
            written = 0
            while written < view.nbytes:
                held.deliver()
                written += os.pwrite(fd, view[written:written + self.WRITE_CHUNK], written)
            mapping = mmap.mmap(fd, view.nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return fd, mapping

    def _up_to_date(self, address: int, view: memoryview, fd: int, mapping, held) -> bool:
        """Compare ``view`` (at ``address``) with the memfd; where chunks
        differ, go on only if nobody holds a shared lock (then write each
        differing chunk in place).  True: the memfd now holds ``view``'s
        bytes; False: it differs and someone may see it."""
        differ = self._differing_chunks(address, _address(mapping), view.nbytes, held)
        if not differ:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            for start in differ:
                held.deliver()   # a stop, between two chunks: the next cell compares again
                written, stop = start, min(view.nbytes, start + self.CHUNK)
                while written < stop:
                    written += os.pwrite(fd, view[written:stop], written)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _differing_chunks(self, mine: int, theirs: int, nbytes: int, held) -> list[int]:
        """The starts of the ``CHUNK``-sized pieces where ``nbytes`` at the
        addresses ``mine`` and ``theirs`` differ.

        libc's ``memcmp`` (ctypes lets the GIL go), on up to
        ``COMPARE_THREADS`` threads at once: a 512 MB array took 83 ms with
        numpy's ``array_equal`` (a temporary, two passes), 70 ms with
        ``memcmp``, 37 ms with two threads, on the bench's 2-core VM; a cell
        that uses 1 GB of globals pays this every time.  The stop button is
        let through between the main thread's chunks: then the helpers stop
        at their next chunk; otherwise each compares all of its part (a
        chunk it skipped would be a change never sent).  Both ways they are
        joined before the memory can go."""
        starts = range(0, nbytes, self.CHUNK)
        threads = max(1, min(self.COMPARE_THREADS, len(starts), cpu_count()))
        found: list[list[int]] = [[] for _ in range(threads)]
        failed: list[BaseException] = []
        stopped = threading.Event()   # only when the main thread's part ends early (a stop)
        memcmp = _memcmp()

        def scan(part: int) -> None:
            for start in starts[part::threads]:
                if part == 0:
                    held.deliver()
                elif stopped.is_set():
                    return
                if memcmp(mine + start, theirs + start, min(self.CHUNK, nbytes - start)):
                    found[part].append(start)

        def helper_scan(part: int) -> None:
            try:
                scan(part)
            except BaseException as exc:   # never a chunk taken for the same unseen: see below
                failed.append(exc)

        helpers = [threading.Thread(target=helper_scan, args=(part,), name="accel_magics-compare", daemon=True)
                   for part in range(1, threads)]
        try:
            for helper in helpers:
                helper.start()
            scan(0)
        except BaseException:
            stopped.set()
            raise
        finally:
            for helper in helpers:
                if helper.ident is not None:
                    helper.join()
        if failed:   # a helper that could not compare: every chunk counts as changed (written, or a new copy)
            return list(starts)
        return sorted(start for part in found for start in part)

    def _drop(self, key: tuple, ref=None) -> None:
        """Let the entry under ``key`` go (only if it is still ``ref``'s, when given)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (ref is not None and entry[0] is not ref):
                return
            del self._entries[key]
        self._release(entry)

    @staticmethod
    def _release(entry: list) -> None:
        _, fd, mapping, _ = entry
        try:
            mapping.close()
        except BufferError:   # a comparison's frame still holds a view (an error's traceback): it
                              # closes with its last view
            pass
        os.close(fd)

    def forget_unreferenced(self, namespace: dict) -> int:
        """Let go, now, of the entries without a weak reference (numpy's)
        whose memory no array of ``namespace`` shows any more: its values,
        and the values one level inside them (containers, attributes).  So
        ``del big`` in the notebook frees its shared copy at that cell's end
        (the kernel calls this after every cell), not :attr:`KEEP_PAYLOADS`
        payloads later.  An array held deeper is let go too: its next cell
        writes it again (correct, slower).  Returns how many went."""
        with self._lock:
            unowned = {key for key, entry in self._entries.items() if entry[0] is None}
        if not unowned:
            return 0
        shown = _array_buffers(namespace)
        gone = [key for key in unowned if key not in shown]
        for key in gone:
            self._drop(key)
        return len(gone)

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self._release(entry)

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(len(entry[2]) for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


def _array_buffers(namespace: dict, inner_limit: int = 1000) -> set[tuple]:
    """(address, nbytes) of the numpy arrays among ``namespace``'s values and
    one level inside them (at most ``inner_limit`` items of each)."""
    np = sys.modules.get("numpy")
    if np is None:
        return set()
    found: set[tuple] = set()

    def note(value) -> None:
        if isinstance(value, np.ndarray):
            try:
                found.add((value.__array_interface__["data"][0], value.nbytes))
            except Exception:   # an ndarray subclass whose interface is its own
                pass

    for value in list(namespace.values()):
        note(value)
        if isinstance(value, dict):
            inner = value.values()
        elif isinstance(value, (list, tuple, set, frozenset)):
            inner = value
        else:
            inner = getattr(value, "__dict__", None)
            inner = inner.values() if isinstance(inner, dict) else ()
        try:
            for item in itertools.islice(list(inner), inner_limit):
                note(item)
        except Exception:   # a container that changed meanwhile, a property that raised
            pass
    return found


#: The kernel's cache of big buffers in shared memory (one per process).
SHARED = SharedCache()


def _forget_leases_in_child() -> None:
    """A process forked from the kernel (a ``multiprocessing`` fork pool, an
    ``os.fork`` in a cell) inherits every open run's descriptors, their
    shared locks included: it never uses them (it has its own copy of the
    arrays), and holding them would keep the kernel from updating that memory
    in place for as long as it lives."""
    for arena in list(SharedArena.open_arenas):
        arena.close()


os.register_at_fork(after_in_child=_forget_leases_in_child)


def _map_shared(ref: tuple):
    """In a rank: a private, writable, copy-on-write view of one shared array."""
    import mmap

    pid, fd, offset, nbytes = ref
    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
        # The shared lock tells the kernel this memory is seen (SharedCache).
        # It belongs to this open file, which the mapping itself keeps open
        # (in this process and in every worker forked from it, whatever
        # descriptors they close), so it goes when the last mapping does:
        # the array dropped, or the last process that maps it gone.
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        mm = mmap.mmap(f.fileno(), offset + nbytes, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return memoryview(mm)[offset:offset + nbytes]


def _shared_storage(buffer, dtype):
    """In a rank: the ``TypedStorage`` of ``dtype`` over one out-of-band
    buffer, as torch's own ``_load_from_bytes`` gives it under plain pickle;
    the tensor around it is rebuilt by torch's reduction (see ``_SharingPickler``)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "non-writable buffer": a rank's is writable, copy-on-write
        untyped = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


class _RankMain:
    """Stands for "the ``__main__`` namespace of the process that unpickles":
    functions defined in the notebook get the rank's ``__main__`` as their
    globals, as they had the kernel's, so the names they use live in
    ``__main__`` and by-reference pickling (``pickle``, ``torch.save``,
    ``multiprocessing``) finds them there."""

    def __reduce__(self):
        return _rank_main_dict, ()


def _rank_main_dict() -> dict:
    return sys.modules["__main__"].__dict__


def _code_from_marshal(data: bytes):
    return marshal.loads(data)


def _lru_cached(wrapped, parameters: dict):
    """A notebook function under ``functools.lru_cache``/``cache``, rebuilt in the
    rank (pickle would look it up as ``__main__.name``, which is not there yet)."""
    import functools

    return functools.lru_cache(maxsize=parameters.get("maxsize"), typed=parameters.get("typed", False))(wrapped)


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    consts = tuple(_with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


#: dtypes of a TypedStorage that is plain bytes (a quantized one, or one torch adds later, is pickled)
_PLAIN_TORCH_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                       "float64", "complex64", "complex128")


class _OutOfBand:
    """pickle's ``buffer_callback`` for one payload: a buffer of the arena's
    threshold and more goes to the arena (the ranks' next out-of-band
    buffer), any other stays in the pickle.  It also keeps what the pickler
    noted on the way: big arrays and tensors whose memory has not (yet)
    gone out of band, and the storages behind the buffers it made itself."""

    def __init__(self, arena: SharedArena) -> None:
        self.arena = arena
        self.pending: dict[tuple, object] = {}   # (address, nbytes) -> a big array or tensor not sent out of band yet
        self.storages: dict[int, tuple] = {}   # id(PickleBuffer) -> (it, the torch storage whose memory it is)

    def __call__(self, buffer) -> bool:
        view = buffer.raw()   # no ``with``: a release that fails on an error's views would replace the error
        if view.nbytes < self.arena.threshold:
            return True
        key = (_address(view), view.nbytes)
        self.pending.pop(key, None)
        self.arena.add(view, key, self.storages.get(id(buffer), (None, None))[1])
        return False

    def report(self) -> None:
        """Each big value that went into the pickle after all says why, once (the hook's log)."""
        for value in self.pending.values():
            hooks.step_aside("shared_globals", _why_pickled(value))
        self.clear()

    def clear(self) -> None:
        self.pending.clear()
        self.storages.clear()


def _why_pickled(value) -> str:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        if type(value) is not np.ndarray:
            return f"{_describe(value)}, an ndarray subclass (numpy pickles it with its data in the pickle)"
        if value.dtype.hasobject:
            return "an ndarray of Python objects"
        return "a non-contiguous ndarray (numpy pickles a copy of its elements)"
    return f"{_describe(value)}, reduced without its storage"


class _SharingPickler(cloudpickle.Pickler):
    """cloudpickle, with big buffers put in the shared arena (pickle's own
    out-of-band buffers: see :class:`SharedArena`), notebook functions bound
    to the rank's ``__main__``, and code that keeps its cell's name
    (cloudpickle renames every file ``<dynamic-code>``)."""

    def __init__(self, file, arena: SharedArena, main_ns: Optional[dict] = None,
                 code_label: Optional[Callable[[str], Optional[str]]] = None) -> None:
        self.out_of_band = _OutOfBand(arena) if arena.enabled else None
        super().__init__(file, protocol=5, buffer_callback=self.out_of_band)
        self.arena = arena
        self.main_ns = main_ns
        self.code_label = code_label
        self.definitions: dict = {}    # notebook functions and classes met on the way, by name
        self.sources: dict = {}        # cell label -> source, for the ranks' linecache

    keep_out: set | frozenset = frozenset()   # names the ranks own (a session's): never overwritten

    def _dynamic_function_reduce(self, func):
        reduced = super()._dynamic_function_reduce(func)
        if self.keep_out and self.main_ns is not None and func.__globals__ is self.main_ns:
            state, slotstate = reduced[2]
            shared = slotstate["__globals__"]
            if any(name in shared for name in self.keep_out):
                # A notebook function that uses a name the session owns finds the
                # session's value in the rank's __main__; the kernel's would replace it.
                slotstate = {**slotstate, "__globals__": {k: v for k, v in shared.items() if k not in self.keep_out}}
                reduced = reduced[:2] + ((state, slotstate),) + reduced[3:]
        return reduced

    def _function_getnewargs(self, func):
        args = super()._function_getnewargs(func)
        if self.main_ns is not None and func.__globals__ is self.main_ns:
            return (args[0], _RankMain()) + tuple(args[2:])
        return args

    def _note_definition(self, obj) -> None:
        name = getattr(obj, "__name__", None)
        if self.main_ns is not None and getattr(obj, "__module__", None) == "__main__" \
                and isinstance(name, str) and self.main_ns.get(name) is obj and not name.startswith("<") \
                and name not in self.keep_out:
            self.definitions[name] = obj

    def _reduce_code(self, code: types.CodeType):
        filename = code.co_filename
        label = self.code_label(filename) if self.code_label is not None else None
        if label:
            if label not in self.sources:
                import linecache

                self.sources[label] = "".join(linecache.getlines(filename))
            code = _with_filename(code, label)
        try:
            return _code_from_marshal, (marshal.dumps(code),)
        except ValueError:   # pragma: no cover - a code object built by hand
            return NotImplemented

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)):
            self._note_definition(obj)
        elif type(obj) is types.CodeType:
            return self._reduce_code(obj)
        elif type(obj).__name__ == "_lru_cache_wrapper" and getattr(obj, "__module__", None) == "__main__":
            self._note_definition(obj)
            return _lru_cached, (obj.__wrapped__, obj.cache_parameters())
        if self.out_of_band is not None:
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(obj, (torch.storage.TypedStorage, torch.UntypedStorage)):
                reduced = self._reduce_storage(obj, torch)
                if reduced is not None:
                    return reduced
            elif torch is not None and isinstance(obj, torch.Tensor):
                self._note_tensor(obj, torch)
            else:
                np = sys.modules.get("numpy")
                if np is not None and isinstance(obj, np.ndarray) and obj.nbytes >= self.arena.threshold:
                    self.out_of_band.pending[(obj.__array_interface__["data"][0], obj.nbytes)] = obj
        return super().reducer_override(obj)

    def _note_tensor(self, tensor, torch) -> None:
        """A big strided tensor: noted until its storage is met (a sparse or
        nested tensor's parts are tensors of their own)."""
        try:
            if tensor.layout != torch.strided or tensor.is_nested:
                return
            storage = tensor.untyped_storage()
            if storage.nbytes() >= self.arena.threshold:
                self.out_of_band.pending[(storage.data_ptr(), storage.nbytes())] = tensor
        except Exception:   # a tensor without storage (a wrapper subclass): its reduction says what it sends
            pass

    def _reduce_storage(self, storage, torch):
        """A big CPU storage of a plain dtype: its bytes go out of band, read
        through its address (``.numpy()`` would make torch mark the notebook's
        storage not resizable for ever), and :func:`_shared_storage` makes it
        a storage again in the rank.  The tensor around it stays torch's own
        reduction (offset, strides, requires_grad, conj/neg bits, Python
        attributes, subclass), and a tensor's storage is a new ``TypedStorage``
        each time, so two tensors that share one share nothing in the rank,
        as under plain pickle.  None: pickled as torch pickles it
        (``torch.save`` of the storage, in band)."""
        typed = isinstance(storage, torch.storage.TypedStorage)
        untyped = storage._untyped_storage if typed else storage
        nbytes = untyped.nbytes()
        if nbytes < self.arena.threshold:
            return None
        address = untyped.data_ptr()
        self.out_of_band.pending.pop((address, nbytes), None)
        why = None
        if not typed:   # torch's own pickle of one does not load back on torch 2.13: neither does ours
            why = "an UntypedStorage (that of a uint16/32/64 or float8 tensor): torch pickles it itself"
        elif type(storage) is not torch.storage.TypedStorage:
            why = f"{_describe(storage)}, a storage class of its own"
        elif untyped.device.type != "cpu":
            why = f"a storage on {untyped.device.type}"
        elif str(storage.dtype).split(".")[-1] not in _PLAIN_TORCH_DTYPES:
            name = str(storage.dtype).split(".")[-1]
            why = f"{'quantized ' if name.startswith(('qint', 'quint')) else ''}dtype {name}"
        if why is not None:
            hooks.step_aside("shared_globals", why)
            return None
        buffer = pickle.PickleBuffer(_memory_at(address, nbytes))
        self.out_of_band.storages[id(buffer)] = (buffer, untyped)
        return _shared_storage, (buffer, storage.dtype)


class _Found:
    """Pickled after the shipped values: by then the pickler has met every
    notebook definition they reach, and each is a reference into the memo."""

    def __init__(self, pickler: _SharingPickler, what: str) -> None:
        self.pickler, self.what = pickler, what

    def __reduce__(self):
        return dict, (list(getattr(self.pickler, self.what).items()),)


def _dumps(value, arena: SharedArena, main_ns: Optional[dict] = None,
           code_label: Optional[Callable[[str], Optional[str]]] = None,
           keep_out: set | frozenset = frozenset()) -> tuple[bytes, dict]:
    import io

    buf = io.BytesIO()
    pickler = _SharingPickler(buf, arena, main_ns, code_label)
    pickler.keep_out = keep_out
    try:
        pickler.dump((value, _Found(pickler, "definitions"), _Found(pickler, "sources")))
        if pickler.out_of_band is not None:
            pickler.out_of_band.report()
        return buf.getvalue(), dict(pickler.sources)
    finally:
        # The memo holds every value sent, and the _Found objects in it hold
        # the pickler: a cycle that kept the kernel's arrays alive (and their
        # kept shared memory) until a garbage collection.
        pickler.clear_memo()
        if pickler.out_of_band is not None:
            pickler.out_of_band.clear()


class _Interrupts:
    seen = False


@contextlib.contextmanager
def _noting_interrupts():
    """Tell the user's interrupt (SIGINT) from a KeyboardInterrupt (or
    SystemExit) that a value's ``__reduce__`` raises while it is pickled."""
    state = _Interrupts()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):
        state.seen = True
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


def _exc_text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except BaseException:
        text = "<str() of the exception failed>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _raise_for_unpicklable(shipped: dict, interrupts: Optional[_Interrupts] = None) -> None:
    """Find which variable(s) cannot be pickled and raise PayloadError naming them."""
    bad = []
    for name, value in shipped.items():
        try:
            cloudpickle.dumps(value, protocol=5)
        except BaseException as exc:  # any pickling failure, whatever its type (SystemExit too)
            if isinstance(exc, KeyboardInterrupt) and interrupts is not None and interrupts.seen:
                raise
            bad.append((name, value, exc))
    if not bad:
        return
    lines = [
        f"cannot send variable '{name}' ({_describe(value)}) to the ranks: {_exc_text(exc)}"
        for name, value, exc in bad
    ]
    first = bad[0][0]
    raise PayloadError(
        "\n".join(lines)
        + f"\nCreate '{first}' inside the %%distributed cell instead (each rank then makes its own), "
        "or pass what it is built from (a path, a config) rather than the object itself."
    )
