"""Runs in a rank (installed once in the launcher, inherited by every fork):
the wrappers of ``torch.distributed``, each a hook of its own (see
``kernel_ext/hooks.py``; each checks the torch internals it needs when it
installs, and ``ACCEL_MAGICS_DISABLE=name`` turns it off):

``keep_groups``
    Process groups are never destroyed by a C++ destructor that holds the
    GIL.  DDP's ``Reducer`` holds a reference to its process group, and
    pybind11 destroys a Reducer with the GIL held.  After
    ``destroy_process_group()`` the Reducer holds the *last* reference, so
    dropping the DDP model (the end of a ``train()`` function) runs
    ``~ProcessGroupGloo`` with the GIL held, which joins the gloo worker
    threads.  A worker that is just then releasing the last reference to a
    finished collective decrefs the Python tensors of that collective, which
    needs the GIL: deadlock, the cell hangs for good (the class of torch bug
    in pytorch#56297; in forked ranks 5-10 of 30 cells).  So the groups that
    ``destroy_process_group`` removes are kept until the rank exits (with
    ``os._exit``: no destructor runs), until the world's next round is set up,
    or, in a session, until the next cell starts (:func:`release_kept`: by
    then none of their workers is still finishing a collective), so fds and
    threads do not grow with rounds.
``round_keys``
    A second ``init_process_group`` of the world after a destroy rendezvous
    under store keys of its own round (:func:`_own_keys`).
``join_wait``
    A rank that set up the world (or a ``new_group``) waits at its end until
    its peers are out of their set-up too (:func:`wait_for_peers_joined`).
``world_size_check``
    ``init_process_group(world_size=N)`` through env:// with N other than the
    run's ranks raises at once (:func:`_refuse_another_world_size`).
``init_events``
    The rank says when it enters and leaves ``init_process_group`` of the
    default world (``joining``, ``joined``: see :data:`announce`), so the
    kernel can tell a rank that waits there for a peer that already finished
    the cell (the peer will never come: the world is fixed) from one that is
    merely slow.
"""
from __future__ import annotations

import _thread
import functools
import os
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

from ..timing import GROUP_DROP_DELAY, STORE_WAIT_FLOOR

#: Process groups kept alive until the rank exits (see the module doc).
_kept: list = []

#: How many times this rank called ``init_process_group`` for the run's world.
_rounds = 0

#: The groups this rank set up in its run, for :func:`wait_for_peers_joined`:
#: (a store, the keys its members set there once out of the set-up).
_joined: list = []
_JOINED_KEY = "accel_magics/joined"

#: How many times this rank called ``new_group`` (every rank calls it in the same order).
_groups = 0

#: Where the rank's ``joining``/``joined`` events go (the worker sets it to its
#: event channel; None outside a rank: nothing is said).
announce: Optional[Callable[[dict], object]] = None


_installed = False

#: Which of the concerns below are in place in this process (see :func:`install`).
on: dict[str, bool] = {}


def _c10d():
    return sys.modules.get("torch.distributed.distributed_c10d"), sys.modules.get("torch.distributed")


def _parameters(fn) -> list[str]:
    import inspect

    return list(inspect.signature(fn).parameters)


# -- each concern's guard: None when the torch it needs is here, else why not -------------------------

def keep_groups_unsupported() -> Optional[str]:
    c10d, _ = _c10d()
    if not hasattr(getattr(c10d, "_world", None), "pg_map"):
        return "torch.distributed.distributed_c10d._world.pg_map is missing"
    if not hasattr(getattr(c10d, "GroupMember", None), "WORLD"):
        return "torch.distributed.distributed_c10d.GroupMember.WORLD is missing"
    if _parameters(c10d.destroy_process_group)[:1] != ["group"]:
        return "destroy_process_group's first parameter is not 'group'"
    return None


def _init_unsupported(*needed: str) -> Optional[str]:
    c10d, _ = _c10d()
    missing = [p for p in needed if p not in _parameters(c10d.init_process_group)]
    if missing:
        return f"init_process_group has no parameter {', '.join(missing)}"
    return None


def round_keys_unsupported() -> Optional[str]:
    import torch.distributed as dist

    for name in ("rendezvous", "PrefixStore"):
        if not hasattr(dist, name):
            return f"torch.distributed.{name} is missing"
    try:
        from torch.distributed.constants import default_pg_timeout  # noqa: F401
    except ImportError:
        return "torch.distributed.constants.default_pg_timeout is missing"
    return _init_unsupported("init_method", "store", "rank", "world_size", "timeout")


def join_wait_unsupported() -> Optional[str]:
    c10d, _ = _c10d()
    for name in ("_get_default_store", "get_rank", "get_world_size", "new_group"):
        if not hasattr(c10d, name):
            return f"torch.distributed.distributed_c10d.{name} is missing"
    if "use_local_synchronization" not in _parameters(c10d.new_group):
        return "new_group has no parameter use_local_synchronization"
    return None


def world_size_check_unsupported() -> Optional[str]:
    return _init_unsupported("init_method", "store", "world_size")


def init_events_unsupported() -> Optional[str]:
    return _init_unsupported("init_method", "store", "world_size")


def install() -> bool:
    """Install the wrappers of ``torch.distributed`` that are turned on, each
    a hook of its own (``kernel_ext/hooks.py``): ``keep_groups``,
    ``round_keys``, ``join_wait``, ``world_size_check``, ``init_events``.
    Done once in the launcher when torch.distributed is loaded (every rank
    inherits it); True when torch.distributed was there to wrap."""
    global _installed
    if _installed:
        return True
    c10d, dist = _c10d()
    if c10d is None:
        return False
    _installed = True
    from .. import hooks

    for name, guard in (("keep_groups", keep_groups_unsupported), ("round_keys", round_keys_unsupported),
                        ("join_wait", join_wait_unsupported), ("world_size_check", world_size_check_unsupported),
                        ("init_events", init_events_unsupported)):
        on[name] = hooks.install(name, lambda name=name: on.__setitem__(name, True), guard=guard)
    if on["keep_groups"]:
        _wrap(c10d, dist, "destroy_process_group", _guarded_destroy)
    if on["round_keys"] or on["world_size_check"] or on["init_events"] or on["join_wait"]:
        _wrap(c10d, dist, "init_process_group", _watched_init)
    if on["join_wait"]:
        _new_group_sync_at = _parameters(c10d.new_group).index("use_local_synchronization")
        _wrap(c10d, dist, "new_group", functools.partial(_watched_new_group, sync_at=_new_group_sync_at))
    return True


def _wrap(c10d, dist, name: str, make) -> None:
    """Replace ``c10d.name`` (and ``torch.distributed.name``, the same function)
    with ``make(original)``, marked as ours; once."""
    original = getattr(c10d, name)
    if getattr(original, "_accel_magics_guard", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper._accel_magics_guard = True
    setattr(c10d, name, wrapper)
    if dist is not None and getattr(dist, name, None) is original:
        setattr(dist, name, wrapper)


def _guarded_destroy(original):
    def destroy_process_group(group=None):
        c10d, _ = _c10d()
        held = _groups_destroyed_by(c10d, group)
        try:
            return original(group)
        finally:
            _keep_referenced(held)
    return destroy_process_group


def _keep_referenced(groups: list) -> None:
    """Keep those of the destroyed ``groups`` that something else still
    references (a DDP module, its Reducer, a variable): their last reference
    could go in a destructor that holds the GIL.  One nothing else holds is
    let go GROUP_DROP_DELAY later, on a thread of its own: its connections
    close then, so a peer still in a collective on it fails ("Connection
    reset by peer") as under torchrun, instead of waiting for ever on a group
    kept open.  Not at once: its destructor joins gloo's workers holding the
    GIL, and one may still be releasing the last collective's tensors (which
    needs the GIL): the deadlock of the module doc, seen on torch 2.4 under
    CI's load when the group went inside destroy_process_group."""
    probe = [object()]
    for unreferenced in probe:   # the same code shape as below: its count is "no other reference"
        alone = sys.getrefcount(unreferenced)
    going = []
    for group in groups:
        (_kept if sys.getrefcount(group) > alone else going).append(group)
    groups.clear()
    if going:
        with _drop_lock:
            _dropping.append((time.monotonic() + GROUP_DROP_DELAY, going))
            start, _dropper[0] = _dropper[0] != os.getpid(), os.getpid()
        if start:
            _thread.start_new_thread(_drop_later, ())


#: Destroyed groups nothing else holds: (when they go, the groups), oldest first.
_dropping: list = []
_drop_lock = _thread.allocate_lock()
_dropper = [0]   # the pid whose dropper thread runs now (a fork has none: 0 or its parent's pid)


def _drop_later() -> None:
    """One ``_thread`` thread at a time (not the user's: not in
    ``threading.enumerate()``): lets each batch go when it is due, ends when
    none is left.  The groups' destructors run here, outside the lock."""
    while True:
        with _drop_lock:
            if not _dropping:
                _dropper[0] = 0
                return
            wait = _dropping[0][0] - time.monotonic()
            batch = _dropping.pop(0) if wait <= 0 else None
        if batch is None:
            time.sleep(wait)
        del batch


def _watched_init(original):
    def init_process_group(*args, **kwargs):
        c10d, _ = _c10d()
        if on.get("world_size_check"):
            _refuse_another_world_size(args, kwargs)
        if not _joins_the_world(args, kwargs):
            return original(*args, **kwargs)
        global _rounds
        _rounds += 1
        _say("joining")
        came = False
        try:
            if _rounds == 1 or not on.get("round_keys"):
                pg = original(*args, **kwargs)
            else:
                pg = original(*args, **_own_keys(_rounds, kwargs))
            came = True
            # A safe point for the groups of earlier rounds: a whole rendezvous
            # since their destroy, so none of their workers is still finishing a
            # collective (what the deadlock needs).
            release_kept()
            if on.get("join_wait"):
                _count_in(c10d, f"{_JOINED_KEY}/world", range(c10d.get_world_size()), fresh=True)
            return pg
        finally:
            _say("joined", came)   # done waiting, whether it succeeded or raised
    return init_process_group


def _watched_new_group(original, sync_at: int):
    """A group's members count themselves in once ``new_group`` returned (its
    connections are set up there too: the same race as the world's)."""
    def new_group(ranks=None, *args, **kwargs):
        global _groups
        c10d, _ = _c10d()
        group = original(ranks, *args, **kwargs)
        local = kwargs.get("use_local_synchronization", len(args) > sync_at - 1 and args[sync_at - 1])
        if local:
            return group   # only its members call it, so the calls cannot be counted alike: not watched
        _groups += 1
        try:
            members = sorted(ranks) if ranks else range(c10d.get_world_size())
            if c10d.get_rank() in members:
                _count_in(c10d, f"{_JOINED_KEY}/group/{_groups}", members)
        except Exception:   # never the cause of a new_group failure
            pass
        return group
    return new_group


def release_kept() -> int:
    """A safe point (a session's next cell, nothing of the last one running):
    let the groups kept by ``keep_groups`` go, with their sockets and threads.
    Returns how many were let go."""
    with _drop_lock:
        dropping, _dropping[:] = list(_dropping), []
    count = len(_kept) + sum(len(groups) for _, groups in dropping)
    _kept.clear()
    del dropping
    return count


def _own_keys(round_: int, kwargs: dict) -> dict:
    """The arguments of a later ``init_process_group`` of the world (after a
    ``destroy_process_group``): the same rendezvous as ``env://``, under keys
    of this round's own.

    Why: torch counts process groups from 0 again after a destroy, so a second
    round writes and reads the same store keys as the first ("default_pg/0/..."
    in the run's store, which outlives the round).  A rank that reads them
    before its peers rewrote them connects to the first round's addresses:
    under torchrun that fails with "Connection refused", here it reached the
    first round's groups (kept alive above) and hung.  Every rank makes the
    same calls in the same order, so the n-th round has the same prefix on
    every rank."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.constants import default_pg_timeout

    rest = {k: v for k, v in kwargs.items() if k not in ("init_method", "rank", "world_size", "store")}
    timeout = kwargs.get("timeout") or default_pg_timeout   # the store's, as env:// would use
    store, rank, world_size = next(rendezvous("env://", rank=kwargs.get("rank", -1),
                                              world_size=kwargs.get("world_size", -1), timeout=timeout))
    return {**rest, "store": PrefixStore(f"accel_magics/round/{round_}", store), "rank": rank,
            "world_size": world_size}


def _refuse_another_world_size(args, kwargs) -> None:
    """``init_process_group(world_size=3)`` through the run's rendezvous
    (env://) in a run of 2 ranks waits for a third rank that never comes:
    torch's timeout is 30 minutes, and no rank has finished, so nothing
    else ends it.  Said at once instead."""
    if kwargs.get("store") is not None or len(args) > 1 or kwargs.get("init_method") not in (None, "env://"):
        return
    size, ours = kwargs.get("world_size", -1), os.environ.get("WORLD_SIZE")
    if size in (-1, None) or ours is None or str(size) == ours:
        return
    raise ValueError(f"init_process_group(world_size={size}): this run has {ours} ranks, so that world would "
                     f"never form (it would wait for torch's 30-minute timeout). Leave world_size out (env:// "
                     f"reads WORLD_SIZE={ours}), or run the cell with {size} ranks (-n / --num_nodes).")


def _joins_the_world(args, kwargs) -> bool:
    """Does this call join the run's world (the one the environment describes)?
    A group of its own (a store, an init_method, another size) is not watched."""
    if kwargs.get("store") is not None or len(args) > 1:
        return False
    if kwargs.get("init_method") not in (None, "env://"):
        return False
    size = kwargs.get("world_size", -1)
    return size in (-1, None) or str(size) == os.environ.get("WORLD_SIZE")


def _count_in(c10d, key: str, members, fresh: bool = False) -> None:
    """After this rank set up a group (the world's ``init_process_group``, a
    ``new_group``): say so in the world's store, and remember whom to wait for
    at the end (:func:`wait_for_peers_joined`).  ``fresh``: a new round of the
    world, whose store is a new one; the earlier rounds' waits are over."""
    global _joined
    try:
        store = c10d._get_default_store()
        store.set(f"{key}/{c10d.get_rank()}", b"1")
        keys = [f"{key}/{r}" for r in members]
    except Exception as exc:   # checked at install: a group whose store is not the world's
        from .. import hooks

        hooks.step_aside("join_wait", f"no store to count in on ({type(exc).__name__}: {exc})")
        return
    _joined = ([] if fresh else _joined) + [(store, keys)]


def wait_for_peers_joined(timeout: float) -> bool:
    """Before a rank that joined the world exits: wait (at most ``timeout``)
    until every rank of its world (its last round) has come out of
    ``init_process_group``, and every member of each group it made since
    out of ``new_group``.

    Why: gloo's ``connectFullMesh`` is done on one rank when its own pairs are
    connected, while a peer may still be finishing its side of them.  A
    cell that only sets the world up (``PartialState(cpu=True)``) and ends
    let the first rank exit at once (a rank that holds sockets does not park,
    so a peer waiting in a collective it never joins fails at once), and its
    closing sockets ended the peer's set-up: "Connection closed by peer".
    A ``new_group`` last in a cell, the same.  A script under torchrun has
    the same race, hidden by the tens of milliseconds its interpreter takes
    to end.  Only the set-up is waited for: a peer that then waits in a
    collective this rank never joins still sees it go at once.  True when
    all came (or there is nothing to wait for)."""
    deadline = time.monotonic() + timeout
    for store, keys in _joined:
        try:
            store.wait(keys, timedelta(seconds=max(STORE_WAIT_FLOOR, deadline - time.monotonic())))
        except Exception:   # a peer that failed there (the run is being stopped), or the store gone
            return False
    return True


def rounds() -> int:
    """How many rounds of the world's ``init_process_group`` this rank began
    (its result says so: a peer waiting in a later round waits for nothing)."""
    return _rounds


def _say(kind: str, came: bool = True) -> None:
    if announce is not None and on.get("init_events"):
        try:
            announce({"kind": kind, "round": _rounds, **({} if came else {"failed": True})})
        except Exception:   # never the cause of an init_process_group failure
            pass


def _groups_destroyed_by(c10d, group) -> list:
    try:
        world = c10d._world
        if group is None or group is c10d.GroupMember.WORLD:
            return list(world.pg_map)
        return [group] if group in world.pg_map else []
    except Exception as exc:   # checked at install; never the cause of an error
        from .. import hooks

        hooks.step_aside("keep_groups", f"the groups could not be read ({type(exc).__name__}: {exc})")
        return []


def kept_count() -> int:
    return len(_kept)
