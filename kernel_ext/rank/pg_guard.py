"""Runs in a rank (installed once in the launcher, inherited by every fork):
process groups are never destroyed by a C++ destructor that holds the GIL.

Why: DDP's ``Reducer`` holds a reference to its process group, and pybind11
destroys a Reducer with the GIL held.  After ``destroy_process_group()`` the
Reducer holds the *last* reference, so dropping the DDP model (the end of a
``train()`` function) runs ``~ProcessGroupGloo`` with the GIL held, which joins
the gloo worker threads.  A worker that is just then releasing the last
reference to a finished collective decrefs the Python tensors of that
collective, which needs the GIL: deadlock, the cell hangs for good (the class
of torch bug in pytorch#56297).  Measured in forked ranks: 5-10 of 30 cells;
a 1 ms sleep before the destroy was enough to avoid it, so it is a race with
the worker's last decref.

The guard keeps a reference to every process group that
``destroy_process_group`` removes, so a Reducer's reference is never the last
one.  The group is still shut down (``destroy_process_group`` does that); its
memory and sockets go when the rank process exits, with ``os._exit`` (no
destructor runs then).  A rank that holds sockets does not park after its
result (``worker._park``), so peers still see the connection close at once.

It also says when a rank enters and leaves ``init_process_group`` for the
default world (``joining``, ``joined``: see :data:`announce`), so the kernel
can tell a rank that waits there for a peer that already finished the cell
(the peer will never come: the world is fixed) from one that is merely slow.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from datetime import timedelta
from typing import Callable, Optional

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


def install() -> bool:
    """Wrap ``torch.distributed.destroy_process_group`` if torch.distributed is
    loaded (idempotent); True when the guard is in place."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return False
    original = getattr(c10d, "destroy_process_group", None)
    if original is None:
        return False
    if getattr(original, "_accel_magics_guard", False):
        return True

    @functools.wraps(original)
    def destroy_process_group(group=None):
        held = _groups_destroyed_by(c10d, group)
        try:
            return original(group)
        finally:
            _kept.extend(held)

    destroy_process_group._accel_magics_guard = True
    c10d.destroy_process_group = destroy_process_group
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group
    _watch_init(c10d, dist)
    return True


def _watch_init(c10d, dist) -> None:
    original = getattr(c10d, "init_process_group", None)
    if original is None or getattr(original, "_accel_magics_guard", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        _refuse_another_world_size(args, kwargs)
        watched = _joins_the_world(args, kwargs)
        if not watched:
            return original(*args, **kwargs)
        global _rounds
        _rounds += 1
        _say("joining")
        came = False
        try:
            if _rounds == 1:
                pg = original(*args, **kwargs)
            else:
                pg = original(*args, **_own_keys(_rounds, kwargs))
            came = True
            _count_in(c10d, f"{_JOINED_KEY}/world", range(c10d.get_world_size()), fresh=True)
            return pg
        finally:
            _say("joined", came)   # done waiting, whether it succeeded or raised

    init_process_group._accel_magics_guard = True
    c10d.init_process_group = init_process_group
    if dist is not None and getattr(dist, "init_process_group", None) is original:
        dist.init_process_group = init_process_group
    _watch_new_group(c10d, dist)


def _watch_new_group(c10d, dist) -> None:
    """A group's members count themselves in once ``new_group`` returned (its
    connections are set up there too: the same race as the world's)."""
    original = getattr(c10d, "new_group", None)
    if original is None or getattr(original, "_accel_magics_guard", False):
        return

    @functools.wraps(original)
    def new_group(ranks=None, *args, **kwargs):
        global _groups
        group = original(ranks, *args, **kwargs)
        if kwargs.get("use_local_synchronization", len(args) > 3 and args[3]):
            return group   # only its members call it, so the calls cannot be counted alike: not watched
        _groups += 1
        try:
            members = sorted(ranks) if ranks else range(c10d.get_world_size())
            if c10d.get_rank() in members:
                _count_in(c10d, f"{_JOINED_KEY}/group/{_groups}", members)
        except Exception:   # never the cause of a new_group failure
            pass
        return group

    new_group._accel_magics_guard = True
    c10d.new_group = new_group
    if dist is not None and getattr(dist, "new_group", None) is original:
        dist.new_group = new_group


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
    except Exception:   # a torch whose internals differ: no wait at the end, as before
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
            store.wait(keys, timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except Exception:   # a peer that failed there (the run is being stopped), or the store gone
            return False
    return True


def rounds() -> int:
    """How many rounds of the world's ``init_process_group`` this rank began
    (its result says so: a peer waiting in a later round waits for nothing)."""
    return _rounds


def _say(kind: str, came: bool = True) -> None:
    if announce is not None:
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
    except Exception:   # a torch whose internals differ: no guard, never an error
        return []


def kept_count() -> int:
    return len(_kept)
