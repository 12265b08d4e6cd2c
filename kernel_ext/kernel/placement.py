"""Placements: where a run's ranks run, and how a stop reaches them.

A run is a *mode* (one-shot, background, restarts, a session's cell) on a
*placement*.  The modes live in :mod:`run` (and :mod:`session`) and know
nothing of where ranks run; a placement knows nothing of modes.  The seam is
two small interfaces, as torch elastic's ``PContext`` (one API, processes or
subprocesses behind it) and ipyparallel's ``BaseLauncher`` (local, MPI, SSH,
Slurm, found through a registry):

* :class:`Placement` starts one *attempt* of a run: the ranks of every node
  it covers, on a fresh rendezvous (a fresh port, or a new round);
* :class:`Attempt` is the kernel's hold on that attempt: its verified
  messages in the one schema (:mod:`..wire.messages`), a stop routed to every
  node, where each rank runs, and its teardown.
* :meth:`Placement.open_session` opens a session's ranks there, a
  :class:`SessionAttempt`: started once, sent each cell, each cell read and
  stopped through an :class:`Attempt` as a run's attempt is; the session
  itself (:mod:`session`) is a mode like the others.

Restarts are then the same loop on every placement (:func:`run.execute`):
a failure on any node ends the attempt on every node (each placement's job),
and the next attempt starts everywhere on a fresh rendezvous.

A new placement (SSH hosts, Kubernetes pods) is one subclass of each (of
:class:`SessionAttempt` too, for sessions), with a ``name``, declared as an entry point of the group ``accel_magics.placements``
(the built-ins are declared there too): :func:`find_placement` finds it by
name, :func:`placement_names` lists them (what ``--launcher`` takes), as
ipyparallel's ``find_launcher_class`` and jupyter_client's provisioner
factory find theirs.  A plug-in is imported when its name is looked up or
the names are listed, never before; one that cannot be imported is left
out, with a one-line warning that names it, and the others still work.
The public face of this is :mod:`accel_magics.placements`.
"""
from __future__ import annotations

import abc
import importlib
import logging
import sys
import threading
from importlib.metadata import entry_points
from typing import ClassVar, Iterator, Optional

log = logging.getLogger("accel_magics.kernel.placement")


class Attempt(abc.ABC):
    """One attempt of a run on some placement, as the kernel sees it.

    ``ranks``: every global rank the kernel watches (rank 0's value comes from
    the first); ``node_of``: rank -> node name where ranks run on several
    nodes the kernel drives ({} otherwise); ``master_port``: the attempt's
    rendezvous port; ``session_cell``: a cell of a session (its ranks outlive it).
    """
    run_id: str
    master_port: int
    ranks: list
    node_of: dict
    finished: bool = False
    session_cell: bool = False
    forced: Optional[str] = None

    @abc.abstractmethod
    def messages(self, heartbeat: Optional[float] = None) -> Iterator[dict]:
        """The attempt's messages, verified, in order, until its ``finished``
        (a ``heartbeat`` message after ``heartbeat`` idle seconds).  When the
        kernel had to end it, the last is a ``finished`` with ``forced`` set.
        ``KeyboardInterrupt`` propagates: the caller interrupts and reads on."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """The stop button (safe from any thread): first call, every rank's
        stacks then a stop; later calls escalate to killing."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop now (SIGKILL if that is not answered)."""

    @abc.abstractmethod
    def close(self) -> None:
        """The attempt is over for the kernel: release what it holds."""

    def answer(self, request: dict, line: Optional[str], why: str = "", paused: float = 0.0) -> None:
        """Answer a rank's ``input_request`` with ``line`` (None: end of input,
        ``why`` says why); ``paused``: the seconds the kernel took to answer (a
        deadline of the kernel's moves by as much).  A placement whose ranks
        cannot ask leaves this as it is: its supervisors answer end of input."""
        log.warning("run %s: an answer for rank %s has no way to its rank on this placement", self.run_id,
                    request.get("rank"))

    def held_reach(self):
        """How the kernel reaches this attempt's failed ranks held for a
        post-mortem after it ended (post_mortem.HeldRun): an object with
        ``alive(held)``, ``reader(held)`` (the run's messages, ``answer``,
        ``tell(address, content)``, ``close(linger)``) and ``close()``.  None:
        this placement holds no rank (its supervisors are told ``debug_hold`` 0)."""
        return None


class SessionAttempt(abc.ABC):
    """A session's ranks on some placement, as the kernel sees them: started
    once on one rendezvous, kept across cells, each cell read and stopped
    through an :class:`Attempt` (:meth:`cell`).  What a session is (its
    names, one cell at a time, lost or alive) is :class:`session.DistributedSession`'s;
    this is only where its ranks are.

    ``id``: the session's run id; ``pids``: global rank -> pid;
    ``master_port``: its rendezvous port; ``node_of``: rank -> node name where
    its ranks are on several nodes the kernel drives ({} otherwise).
    """
    id: str = ""
    master_port: int = 0
    node_of: dict = {}

    @abc.abstractmethod
    def open(self) -> None:
        """Start the ranks; return once every one is set up (``id``, ``pids``,
        ``master_port`` known), else raise ``errors.SessionGone`` (or
        ``LauncherError``), having ended what had started."""

    @abc.abstractmethod
    def cell(self, run_id: str, timeout: Optional[float]) -> Attempt:
        """The attempt one cell (or the session's stop) under ``run_id`` is
        read and stopped through (the cell itself goes by :meth:`send`)."""

    @abc.abstractmethod
    def send(self, op: str, content: dict) -> None:
        """A cell (``op`` "cell") or the session's stop ("stop") to every part
        of the session; ``LauncherError`` if one is gone."""

    @abc.abstractmethod
    def lost_since(self) -> Optional[str]:
        """Why the ranks ended by themselves since the last look, or None."""

    def said_lost(self, wait: float) -> Optional[str]:
        """The "session lost" already said (waited for up to ``wait`` seconds),
        or None (by default: what :meth:`lost_since` finds)."""
        return self.lost_since()

    @abc.abstractmethod
    def end(self, attempt: Optional[Attempt]) -> None:
        """After the stop (or a loss): every part gone (a bounded wait), what is
        left killed.  ``attempt``: the stop's or the last cell's, if any."""

    @abc.abstractmethod
    def release(self) -> None:
        """The session is over for the kernel: what it holds is let go."""

    def stop_id(self) -> str:
        """The run id the session's stop is answered under (the session's own by default)."""
        return self.id

    def learn_modules(self, modules: list) -> None:
        """Modules a cell imported that were not preloaded (nothing by default)."""

    def ended_under(self, exc: BaseException) -> None:
        """What held the ranks ended under a cell (``exc`` says what), after
        the session is forgotten (nothing by default)."""

    def locate(self, rows: list, current: Optional[str]) -> list:
        """The status rows (one per rank, read on this machine) with where each
        rank runs, as this placement can tell (as they are by default);
        ``current``: the cell the session runs now."""
        return rows


def session_lost_why(msg: dict) -> Optional[str]:
    """Why a session's supervisor says it lost the session, if ``msg`` says so."""
    if msg.get("kind") == "session_lost" or (msg.get("kind") == "finished" and msg.get("lost")):
        return msg.get("lost") or "its ranks ended"
    return None


class Placement(abc.ABC):
    """Where ranks run: starts attempts (see the module doc)."""

    #: What ``--launcher`` takes: the name of its entry point (the same).
    name: ClassVar[str] = ""
    #: A plug-in's one line for ``--launcher``'s help ("" : the help names its class).
    description: ClassVar[str] = ""

    @abc.abstractmethod
    def launch(self, cfg, payload, *, attempt: int = 0, log_dir: str = "", excerpt=None,
               events=None) -> Attempt:
        """Start attempt ``attempt`` of a run of ``payload`` with ``cfg``, on a
        fresh rendezvous.  ``events``: a socket of its own to read it on (a run
        read outside the kernel's main thread), where the placement has one."""

    def open_session(self, cfg) -> "SessionAttempt":
        """A session's ranks here (not started yet: :meth:`SessionAttempt.open`
        starts them).  A placement that cannot keep ranks across cells says so."""
        raise NotImplementedError(f"the placement {self.name!r} cannot run sessions")

    def done(self, attempt: Attempt) -> None:
        """An attempt's messages are all read (bookkeeping; nothing by default)."""

    def learn_modules(self, modules: list) -> None:
        """Modules a run imported that were not preloaded (a placement that
        preloads may preload them next time; nothing by default)."""


#: The entry point group placements are declared in (pyproject.toml's
#: ``[project.entry-points."accel_magics.placements"]``).
GROUP = "accel_magics.placements"
#: The built-in placements, found also where this package's metadata is not
#: installed (a source checkout on sys.path); their entry points say the same.
BUILT_IN = {"local": "accel_magics.kernel_ext.kernel.local_placement:LocalPlacement",
            "slurm": "accel_magics.kernel_ext.kernel.slurm:SlurmPlacement"}


def how_to_add(group: str = GROUP) -> str:
    return ("A new one is a subclass of accel_magics.placements.LocalPlacement (or Placement) with a `name`, "
            f"declared as an entry point of the group {group!r} of an installed package "
            "(see help(accel_magics.placements)).")


class PlacementNotFound(LookupError):
    """No placement of that name could be had; the message lists the known
    names (and the plug-ins left out, with why) and says how to add one."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PlacementRegistry:
    """The placements of one entry point group, by name (the built-ins
    first).  Nothing is imported before a name is looked up or the names are
    listed; each plug-in is imported once, and one that fails stays left out
    (with one warning) for the life of the process."""

    def __init__(self, group: str = GROUP, built_in: Optional[dict] = None) -> None:
        self.group = group
        self.built_in = dict(BUILT_IN if built_in is None else built_in)
        self._declared: Optional[dict] = None   # name -> (entry point value "module:attr", where it comes from)
        self._classes: dict = {}                 # name -> class, once imported
        self.broken: dict = {}                   # name -> why it was left out
        self._lock = threading.RLock()

    def declared(self) -> dict:
        """name -> (``module:attr``, the package that declares it): read once."""
        with self._lock:
            if self._declared is None:
                self._declared = self._read()
            return self._declared

    def _read(self) -> dict:
        found = {name: (value, "accel_magics") for name, value in self.built_in.items()}
        try:
            points = list(entry_points(group=self.group))
        except Exception as exc:   # unreadable metadata of some package: the built-ins still work
            self._warn(f"the entry points of {self.group!r} could not be read ({_one_line(exc)}); "
                       "only the built-in placements are available")
            return found
        for point in points:
            dist = getattr(point, "dist", None)
            where = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
            if point.name in found:
                if found[point.name][0] != point.value:   # the built-ins' own entry points say the same
                    self._warn(f"placement plug-in {point.name!r} ({point.value}, from {where}) ignored: the name "
                               f"is taken by {found[point.name][0]} (from {found[point.name][1]})")
                continue
            found[point.name] = (point.value, where)
        return found

    def names(self) -> tuple:
        """Every placement that can be had, the built-ins first: each plug-in
        is imported (once); one that fails is left out, with a warning."""
        with self._lock:
            for name in self.declared():
                self._load(name)
            return tuple(name for name in self.declared() if name in self._classes)

    def find(self, name: str) -> type:
        """The placement class ``name``; :class:`PlacementNotFound` if none can be had."""
        with self._lock:
            if name not in self.declared():
                raise PlacementNotFound(self.unknown(name))
            cls = self._load(name)
            if cls is None:
                raise PlacementNotFound(f"the placement {name!r} could not be loaded: {self.broken[name]}. "
                                        f"Known: {', '.join(self.names())}.")
            return cls

    def describe(self) -> dict:
        """name -> what a plug-in is (its ``description``, else where it comes from; ""
        for a built-in, which ``--launcher``'s own help describes)."""
        described = {}
        for name in self.names():
            value, where = self.declared()[name]
            own = self._classes[name].__dict__.get("description", "")
            described[name] = "" if name in self.built_in else own or f"a plug-in: {value}, from {where}"
        return described

    def unknown(self, name: str) -> str:
        known = ", ".join(self.names())
        left_out = "".join(f" Left out: {n!r} ({why})." for n, why in self.broken.items())
        return f"there is no placement {name!r}. Known: {known}.{left_out} {how_to_add(self.group)}"

    def _load(self, name: str) -> Optional[type]:
        if name in self._classes or name in self.broken:
            return self._classes.get(name)
        value, where = self.declared()[name]
        try:
            cls = _import(value)
            if not (isinstance(cls, type) and issubclass(cls, Placement)):
                raise TypeError(f"{value} is not a subclass of accel_magics.placements.Placement")
            if cls.name != name:
                raise ValueError(f"its class's name is {cls.name!r}, not {name!r} (they must be the same)")
        except (Exception, SystemExit) as exc:
            self.broken[name] = _one_line(exc)
            if name in self.built_in:
                raise   # a broken built-in is a broken install: never hidden
            self._warn(f"placement plug-in {name!r} ({value}, from {where}) could not be loaded and is left "
                       f"out: {self.broken[name]}")
            return None
        self._classes[name] = cls
        return cls

    @staticmethod
    def _warn(text: str) -> None:
        log.info("%s", text)   # said on stderr once: the log has it too
        print(f"accel_magics: {text}", file=sys.stderr)


def _import(value: str):
    """The object an entry point's ``module:attr`` value names."""
    module, _, attr = value.partition(":")
    obj = importlib.import_module(module.strip())
    for part in filter(None, attr.strip().split(".")):
        obj = getattr(obj, part)
    return obj


#: This process's placements: the entry points of :data:`GROUP`.
REGISTRY = PlacementRegistry()


def find_placement(name: str) -> type:
    """The placement class ``--launcher name`` runs on (imported now if need
    be); :class:`PlacementNotFound`, whose message lists the known names and
    says how to add one, if there is none."""
    return REGISTRY.find(name)


def placement_names() -> tuple:
    """The names ``--launcher`` takes, the built-ins first (every plug-in imported)."""
    return REGISTRY.names()


def placement_descriptions() -> dict:
    """name -> one line on what it is, as ``--launcher``'s help words it."""
    return REGISTRY.describe()
