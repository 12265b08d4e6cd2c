"""Every way a rank differs from a plain torchrun process, by name: the hooks.

The product is fast because it does things a script under torchrun does not:
ranks forked from a launcher that imported torch once, big globals through
shared memory, a store on a socket bound ahead, wrappers around
``torch.distributed``.  Each of them is a *hook* declared in :data:`HOOKS`,
and each follows one contract:

* it checks the torch / Python / platform feature it relies on when it
  installs (its *guard*), and steps aside for the plain path where that
  feature is missing or differs;
* it can be turned off by name: ``ACCEL_MAGICS_DISABLE=name,name`` in the
  kernel's environment (``%env`` works: a change reaches the next cell, see
  ``kernel.launcher``), ``all`` for every hook;
* it says in the log (logger ``accel_magics.hooks``, the process's own log:
  the launcher's for launcher, supervisor and rank hooks, the run's
  ``kernel.log`` for the kernel's) when it installs, steps aside, is turned
  off or fails; :func:`states` tells the same to code.

Installing through :func:`install` gives all of that in one call::

    hooks.install("tqdm", guard=_tqdm_guard, do=_patch_tqdm)

``guard()`` returns None when the hook can work here, else why not (one
line); ``do()`` installs it and may return a detail for the log line.
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

log = logging.getLogger("accel_magics.hooks")

ENV = "ACCEL_MAGICS_DISABLE"


@dataclass(frozen=True)
class Hook:
    name: str
    process: str      # where it installs: kernel, launcher, supervisor or rank
    summary: str      # what it changes, against a plain torchrun process


class HookState(enum.Enum):
    INSTALLED = "installed"
    STEPPED_ASIDE = "stepped aside"    # its guard found the feature it needs missing: the plain path
    DISABLED = "disabled"              # turned off by name (ACCEL_MAGICS_DISABLE)
    FAILED = "failed"                  # installing raised: the plain path, and the error in the log


def _declare(*hooks: Hook) -> dict[str, Hook]:
    return {hook.name: hook for hook in hooks}


#: The one table of hooks (docs/reference/hooks.md's table is checked against it).
HOOKS: dict[str, Hook] = _declare(
    Hook("store", "supervisor",
         "node 0's supervisor hosts torch's TCPStore on a socket bound before the ranks start, as torchrun's "
         "agent store (TORCHELASTIC_USE_AGENT_STORE); off: the store is created eagerly on the port"),
    Hook("keep_groups", "rank",
         "destroy_process_group keeps a reference to the destroyed groups until the next safe point, so a "
         "DDP Reducer's destructor never runs a group's destructor holding the GIL (pytorch#56297)"),
    Hook("join_wait", "rank",
         "a rank that set up the world (or a new_group) waits at its end, at most PEERS_JOIN_WAIT, until its "
         "peers are out of their set-up too"),
    Hook("round_keys", "rank",
         "a second init_process_group of the world after a destroy uses store keys of its own round"),
    Hook("world_size_check", "rank",
         "init_process_group(world_size=N) through env:// with N other than the run's ranks raises at once "
         "instead of waiting for torch's 30-minute timeout"),
    Hook("init_events", "rank",
         "init_process_group of the world says when a rank enters and leaves it (the view's 'waiting for "
         "peers', the stall check)"),
    Hook("tqdm", "rank", "tqdm bars become progress events (the view's bars) instead of carriage-return lines"),
    Hook("script_end", "rank",
         "the end of a cell runs what the end of a script runs (atexit, non-daemon threads, finalizers)"),
    Hook("heartbeat", "rank",
         "a thread in each rank beats (the stall check) and dumps the Python stacks when asked"),
    Hook("native_stacks", "supervisor", "py-spy reads a stuck rank's native frames (C++ too) on a timeout or stall"),
    Hook("hugepages", "launcher", "the launcher's heap is moved to huge pages while idle (cheaper forks)"),
    Hook("reverse_dns", "launcher",
         "torch.distributed's reverse DNS lookups of store peers are turned off in the launcher (inherited)"),
    Hook("step_stop", "rank", "a session's stop lands after an optimizer step, not inside one"),
    Hook("cuda_watch", "kernel",
         "the kernel records where CUDA/XPU was first initialised, for the pre-flight check's message"),
    Hook("shared_globals", "kernel",
         "big plain arrays and tensors (8 MB and more) reach the ranks through shared memory instead of the pickle"),
)


class UnknownHook(ValueError):
    pass


def disabled(environ: Optional[Mapping[str, str]] = None) -> set[str]:
    """The hooks turned off by ``ACCEL_MAGICS_DISABLE`` in ``environ`` (this
    process's environment by default); ``all`` turns every hook off."""
    environ = os.environ if environ is None else environ
    names = {n.strip() for n in environ.get(ENV, "").replace(";", ",").split(",") if n.strip()}
    return set(HOOKS) if "all" in names else names


def unknown(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """Names in ``ACCEL_MAGICS_DISABLE`` that are not hooks (a typo turns nothing off)."""
    environ = os.environ if environ is None else environ
    names = {n.strip() for n in environ.get(ENV, "").replace(";", ",").split(",") if n.strip()}
    return sorted(names - set(HOOKS) - {"all"})


def check_names(environ: Optional[Mapping[str, str]] = None) -> None:
    """Raise :class:`UnknownHook` naming what to write instead, if the variable names no hook."""
    bad = unknown(environ)
    if bad:
        raise UnknownHook(f"{ENV} names {', '.join(repr(b) for b in bad)}, which "
                          f"{'is not a hook' if len(bad) == 1 else 'are not hooks'}; the hooks are: "
                          f"{', '.join(sorted(HOOKS))} (or 'all').")


def enabled(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    if name not in HOOKS:
        raise KeyError(f"no hook named {name!r}")
    return name not in disabled(environ)


_states: dict[str, tuple[HookState, str]] = {}


def report(name: str, state: HookState, detail: str = "") -> None:
    """Record and log what became of hook ``name`` in this process."""
    if name not in HOOKS:
        raise KeyError(f"no hook named {name!r}")
    if _states.get(name, (None,))[0] is state:
        return   # said once per process tree (a fork inherits what its parent said; see preview)
    _states[name] = (state, detail)
    level = logging.WARNING if state is HookState.FAILED else logging.INFO
    log.log(level, "hook %s %s%s", name, state.value, f": {detail}" if detail else "")


def state(name: str) -> Optional[HookState]:
    entry = _states.get(name)
    return entry[0] if entry else None


def states() -> dict[str, tuple[HookState, str]]:
    """What each hook that was asked for in this process became, with its detail."""
    return dict(_states)


def install(name: str, do: Callable[[], object], guard: Optional[Callable[[], Optional[str]]] = None,
            environ: Optional[Mapping[str, str]] = None) -> bool:
    """Install hook ``name`` by calling ``do()``, unless it is turned off or
    ``guard()`` says why it cannot work here.  True when it is in place.
    A ``do()`` that raises leaves the plain path: logged, never raised
    (a hook is never the cause of a failure)."""
    if not enabled(name, environ):
        report(name, HookState.DISABLED, f"{ENV}")
        return False
    if guard is not None:
        try:
            why = guard()
        except Exception as exc:   # a guard that cannot tell: the plain path
            why = f"its check failed: {type(exc).__name__}: {exc}"
        if why:
            report(name, HookState.STEPPED_ASIDE, why)
            return False
    try:
        detail = do()
    except Exception as exc:
        report(name, HookState.FAILED, f"{type(exc).__name__}: {exc}")
        return False
    report(name, HookState.INSTALLED, detail if isinstance(detail, str) else "")
    return True


def preview(name: str, guard: Optional[Callable[[], Optional[str]]] = None, detail: str = "",
            environ: Optional[Mapping[str, str]] = None) -> bool:
    """In the launcher, for a hook each rank installs: decide and log it once
    here (every fork inherits what was said, so a rank logs only a state that
    differs).  True when the ranks will install it."""
    if not enabled(name, environ):
        report(name, HookState.DISABLED, ENV)
        return False
    why = guard() if guard is not None else None
    if why:
        report(name, HookState.STEPPED_ASIDE, why)
        return False
    report(name, HookState.INSTALLED, detail)
    return True


_asides: set[tuple[str, str]] = set()


def step_aside(name: str, why: str) -> None:
    """A hook that is installed cannot serve this case (this value, this
    call): the plain path is taken for it; logged once per reason and
    process.  The hook's state stays what it was."""
    if name not in HOOKS:
        raise KeyError(f"no hook named {name!r}")
    if (name, why) not in _asides:
        _asides.add((name, why))
        log.info("hook %s stepped aside: %s", name, why)
