"""``%distributed_session`` and ``%%distributed --session``: ranks that stay.

A session is opt-in: ``%distributed_session start -n 2`` starts N ranks with
the torchrun environment that live until ``stop`` (or the kernel ends);
``%%distributed --session`` cells run on them one at a time, each rank
keeping its own namespace.  The engine side is ``kernel_ext.kernel.session``; this
module only adapts it to IPython (flags, messages, the view, the handle).
"""
from __future__ import annotations

import time
import types

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from accel_magics.kernel_ext import options
from accel_magics.kernel_ext.kernel.errors import CompletedBeforeTheStop, DistributedRunError, ReportedError, WaitStopped
from accel_magics.kernel_ext.kernel.events import bytes_text
from accel_magics.kernel_ext.timing import BACKGROUND_END_WAIT, CELL_HEARTBEAT, WAIT_TICK
from accel_magics.kernel_ext.wire.payload import NameCollector, parse
from accel_magics.kernel_ext.kernel.local_placement import LocalPlacement
from accel_magics.kernel_ext.kernel.session import DistributedSession, SessionGone

from .magics import CELL_MODES, LAUNCH_OPTION_NAMES, parse_options, return_names_of, launch_options
from .slurm_magic import check_agents_free, start_session
from . import rank_prompt

#: Options a session fixes when it starts: a session cell cannot change them (the table says which).
SESSION_FIXED = options.SESSION_FIXED
NO_SESSION = ("no session is running: start one with `%distributed_session start -n 2` (it takes the launch "
              "options of %%distributed), then run this cell again. Nothing was launched.")


def _names_read(source: str) -> set:
    collector = NameCollector()
    collector.visit(parse(source, "<cell>"))
    return set(collector.loaded)


def session_cell(magics, args, line: str, cell: str, started: float):
    """``%%distributed --session``: the cell on the running session's ranks:
    checked, in its turn (after the session's running background cell), then
    run in the foreground or, with ``--background``, in a thread of its own."""
    state = magics.state
    session = _running_session(state.session, args.launcher)
    on_slurm = (session.options.get("launcher") or "local") == "slurm"
    if on_slurm:   # one reader of the allocation's agents at a time
        check_agents_free(state)
    return_names, timeout = _cell_options(args, session)
    busy = session.current
    if args.background and busy:
        raise UsageError(f"the session is running {busy} (a session runs one cell at a time): wait for it "
                         "(its handle's .wait()) or stop it (.stop()), then run this cell again. Nothing was run.")
    source = magics.cell_source(line, cell)
    label = f"In[{magics.cell_number()}]"
    presenter, payload, owned = _in_turn(magics, args, started, session, busy, lambda owned: magics.make_payload(
        source, return_names, defined=owned, share=not on_slurm))
    _say_which_names(magics, source, owned, session)
    run = _runner(magics.state, session, payload, label, presenter, timeout, hold=magics.takes_input())
    if args.background:
        handle = magics.start_background(presenter, run, label=label, where="in the session", owner=session,
                                         release=payload.release)
        if on_slurm:
            state.agents_used_by(handle)
        return handle
    return _in_foreground(magics, session, run)


def _running_session(session, launcher: str | None):
    """The running session, if the cell's ``--launcher`` (if any) is its own;
    else a UsageError that says how to go on."""
    if session is None or not session.alive:
        if session is not None and session.lost:   # the way back is its own options, not a generic start
            raise UsageError(f"no session is running (the last one was lost: {session.lost}): "
                             "`%distributed_session restart` starts a new one with the same options, then run "
                             "this cell again. Nothing was launched.")
        raise UsageError(NO_SESSION)
    placed = session.options.get("launcher") or "local"
    if launcher is not None and launcher != placed:
        raise UsageError(f"the session runs with --launcher {placed}: --launcher belongs to the session, fixed "
                         f"when it started (`%distributed_session restart --launcher {launcher}` starts a "
                         "fresh one there; its state is lost). Nothing was run.")
    return session


def _cell_options(args, session) -> tuple[list, float | None]:
    """The cell's ``--return`` names and time limit; a UsageError for an
    option that belongs to the session, or a limit that is not one."""
    fixed = [f"--{name}" for name in SESSION_FIXED if getattr(args, name, None) is not None]
    if fixed:
        raise UsageError(f"{', '.join(fixed)} belong(s) to the session, fixed when it started: "
                         f"`%distributed_session restart {' '.join(fixed)} ...` starts a fresh one with them "
                         "(its state is lost). Nothing was run.")
    return_names = return_names_of(args.return_names)
    if args.timeout is None:
        return return_names, session.cfg.timeout
    from accel_magics.kernel_ext.environment import ConfigError, check_seconds

    try:
        check_seconds("--timeout", args.timeout)
    except ConfigError as exc:
        raise UsageError(f"{exc}\nNothing was run.") from None
    return return_names, args.timeout


def _in_turn(magics, args, started: float, session, busy, payload_of):
    """The cell's view, shown at once, and its payload (``payload_of(the names
    the session owns)``), once the session's running cell ``busy`` (if any) has
    ended: the names it set count."""
    note = f"waiting for {busy} to finish (the session runs one cell at a time)" if busy else ""
    presenter = None
    try:
        # The stop button may come while the view shows "waiting for ..." (being made,
        # or after): either way this cell has not run, and only the waiting stops.
        context = f"on the session: its cell {session.cells_run + 1 + (1 if busy else 0)}"
        presenter = magics.presenter(args, started, background=args.background, note=note, context=context)
        if busy:
            while not session.wait_idle(WAIT_TICK):
                presenter.tick()   # the view's elapsed time moves on while it waits
        owned = set(session.owned)
        # Ranks on other machines cannot map the kernel's shared memory: a Slurm session's values are pickled.
        return presenter, payload_of(owned), owned
    except BaseException as exc:
        if presenter is not None:
            presenter.discard()
        if busy and isinstance(exc, KeyboardInterrupt):
            raise WaitStopped(f"stopped while it waited for {busy}: this cell did not run; {busy} goes on "
                              "(its handle's .stop() stops it)") from None
        raise


def _runner(state, session, payload, label: str, presenter, timeout, hold: bool = False):
    """The cell's run on the session (``run(control)``; in a background run's thread too).
    ``hold``: a rank that fails keeps the cell's frames for ``%distributed_debug``
    (a background cell's: for its handle's ``.debug()``)."""
    def run(control=None):
        try:
            return session.run_cell(payload, label, on_event=presenter, heartbeat=CELL_HEARTBEAT,
                                    log_dir=presenter.log_dir, excerpt=presenter.excerpt, timeout=timeout, control=control,
                                    on_restart=lambda line: print(f"accel_magics: {line}", flush=True),
                                    ask=rank_prompt.ask if control is None else control.questions.ask, hold=hold)
        except DistributedRunError as exc:
            state.keep_failed(exc.held)
            raise
        except SessionGone as exc:
            raise UsageError(f"{exc}. Start a new one: `%distributed_session restart`. Nothing was run.") from None
        finally:
            presenter.finish()
    return run


def _in_foreground(magics, session, run):
    """Run it now; the notebook gets its result (and ``--return`` names)."""
    try:
        result = run()
    except KeyboardInterrupt as exc:   # a press as its view was finished: after the cell, if it completed
        if isinstance(exc, ReportedError) or session.completed is None:
            raise
        raise CompletedBeforeTheStop(session.completed) from None
    value = magics.deliver(result)
    magics.state.note_returned(result.returns, magics.shell.user_ns)
    return value


def _say_which_names(magics, source: str, owned: set, session) -> None:
    """Both the session and the notebook have a name the cell uses: the
    session's is used (the rule); say so, never silently."""
    user_ns = magics.shell.user_ns
    both = sorted(name for name in _names_read(source) & owned
                  if name in user_ns and not name.startswith("_") and not isinstance(user_ns[name], types.ModuleType)
                  and magics.state.returned.get(name) != id(user_ns[name]))
    new = [name for name in both if name not in session.told]
    if new:   # once per name: the rule holds for every later cell, a repeat would only be noise
        session.told.update(new)
        listed = ", ".join(f"`{n}` (set by {session.owned[n]})" for n in new)
        print(f"accel_magics: the session's own {listed} used, not the notebook's (said once; so for every "
              f"later cell). To send the notebook's value instead: `%distributed_session push {' '.join(new)}`.")


CELL_MODES["session"] = session_cell


def _refuse_cell_options(given: dict) -> None:
    """UsageError for the options a session cannot take (each cell's own, or
    restarts), before anything is started or stopped."""
    for name, why in (("output", "a cell option: give it on the %%distributed --session cell"),
                      ("timeout", "a cell option: give it on the %%distributed --session cell")):
        if given.get(name):
            raise UsageError(f"--{name} cannot be given to a session ({why}). Nothing was started.")


@magics_class
class SessionMagics(Magics):
    """``%distributed_session start|stop|restart|status|push``."""

    def __init__(self, shell, dist, state) -> None:
        super().__init__(shell)
        self.dist = dist     # the DistributedMagics: its defaults and the steps of a cell
        self.state = state   # the kernel's launcher and session (state.MagicsState)

    @magic_arguments()
    @argument("action", nargs="?", default="status", choices=("start", "stop", "restart", "status", "push"),
              help="start: N persistent ranks; stop: end them (frees their memory, GPU memory included); "
                   "restart: stop, then start with the same options (state gone); status: per rank pid, state, "
                   "memory and the cell it runs; push NAMES: the notebook's values of NAMES replace the "
                   "session's in the next cells that use them.")
    @argument("names", nargs="*", help="push: the names.")
    @launch_options
    @line_magic
    def distributed_session(self, line: str):
        """Keep ranks, and what they hold, across ``%%distributed --session`` cells.

        Example::

            %distributed_session start -n 2

            %%distributed --session
            from accelerate import Accelerator
            accelerator = Accelerator()
            model, optimizer = accelerator.prepare(make_model(), make_optimizer())

            %%distributed --session --return loss
            loss = train_one_epoch(model, optimizer)

            %distributed_session stop
        """
        args = parse_options(self.distributed_session, line)
        if args.names and args.action != "push":
            raise UsageError(f"unexpected {' '.join(args.names)!r}: only `push` takes names.")
        return getattr(self, "_" + args.action)(args)

    # -- actions -----------------------------------------------------------------
    def _given(self, args) -> dict:
        return {name: getattr(args, name) for name in LAUNCH_OPTION_NAMES if getattr(args, name) is not None}

    def _start(self, args, given=None):
        session = self.state.session
        if session is not None and session.alive:
            raise UsageError(f"a session is already running ({len(session.pids)} ranks): "
                             "`%distributed_session restart` starts a fresh one, `stop` ends it.")
        given = self._given(args) if given is None else given
        default = self.dist.launch_defaults.given().get("launcher")
        if given.get("launcher") is None and default:
            given["launcher"] = default
        _refuse_cell_options(given)
        placed = self.dist.placement_class(self.dist.placement_name(given.get("launcher")),
                                           nothing="Nothing was started.")
        on_slurm = not issubclass(placed, LocalPlacement)   # every node of the allocation
        started = time.monotonic()
        try:
            if on_slurm:
                session = start_session(self.dist, given)
                cfg = session.cfg
            else:
                args_like = _Args(given)
                cfg = self.dist.launch_config(args_like)   # its --timeout (a default) is the cells' default
                _restarts_here(cfg, given)
                self.dist.preflight_check()
                self.dist.warn_machine(cfg)
                session = DistributedSession(placed(self.state.launcher), cfg, options=given)
                session.start()
        except KeyboardInterrupt:
            raise
        except SessionGone as exc:
            raise UsageError(f"{exc}. Nothing is left running.") from None
        self.state.session = session
        where = (f" on each of {cfg.num_nodes} node(s) of the allocation" if on_slurm else
                 f" on node {cfg.node_rank} of {cfg.num_nodes}" if cfg.num_nodes > 1 else "")
        print(f"accel_magics: session started: {cfg.num_processes} rank(s)" + where
              + f", world size {cfg.world_size}, in {time.monotonic() - started:.2f}s. "
              "Run cells on it with %%distributed --session.")

    def _stop(self, args, quiet: bool = False):
        session = self.state.session
        if session is None or not session.alive:
            if not quiet:
                print("accel_magics: no session is running.")
            return
        own = [run for run in list(self.state.background_runs) if run.owner is session]
        for run in own:   # its background cell first (one-shot background runs have ranks of their own)
            run.stop()
        for run in own:
            run.wait(BACKGROUND_END_WAIT)
        started = time.monotonic()
        session.stop()
        if quiet:
            return
        if session.lost:   # it had ended by itself (a rank died at its prompt): say so, not "stopped"
            print(f"accel_magics: the session had already ended: {session.lost}. What was left of it is gone "
                  f"({time.monotonic() - started:.2f}s).")
        else:
            print(f"accel_magics: session stopped ({session.cells_run} cell(s) run); its ranks are gone "
                  f"({time.monotonic() - started:.2f}s).")

    def _restart(self, args):
        session = self.state.session
        given = dict(session.options) if session is not None else {}
        given.update(self._given(args))
        _refuse_cell_options(given)   # before the running session is stopped: a refusal leaves it running
        self.dist.placement_class(self.dist.placement_name(given.get("launcher")),
                                  nothing="The session was left as it was.")
        self._stop(args, quiet=True)
        self._start(args, given)

    def _status(self, args):
        session = self.state.session
        if session is None:
            print("accel_magics: no session (start one with `%distributed_session start -n 2`).")
            return
        try:
            if session.current is None:
                session.check()
        except SessionGone as exc:
            print(f"accel_magics: {exc}. `%distributed_session restart` starts a new one.")
            return
        if not session.alive:
            print(f"accel_magics: the session was lost: {session.lost}. `%distributed_session restart` starts a "
                  "new one.")
            return
        rows = session.status()
        cfg = session.cfg
        print(f"session: {len(rows)} rank(s), world size {cfg.world_size}, {session.cells_run} cell(s) run, "
              f"{session.current + ' running' if session.current else 'idle'}; "
              f"{len(session.owned)} name(s) of its own")
        if session.owned:   # what is in the ranks' memory, as rank 0 last had it
            width = max(len(name) for name in session.owned)
            kinds = {name: session.kinds.get(name, ("?", None)) for name in session.owned}
            wide = max(len("type"), *(len(kind) for kind, _ in kinds.values()))   # a type name is never cut
            print(f"  {'name':<{width}}  {'type':<{wide}} {'size':>9}  set by")
            for name in sorted(session.owned):
                kind, size = kinds[name]
                print(f"  {name:<{width}}  {kind:<{wide}} {bytes_text(size):>9}  {session.owned[name]}")
        nodes = any(row.get("node") for row in rows)   # a session on several nodes: where each rank is
        print(f"{'rank':>4}  " + (f"{'node':<8} " if nodes else "") +
              f"{'pid':>7}  {'state':<9} {'RSS':>9}  {'GPU mem':>9}  cell")
        for row in rows:
            print(f"{row['rank']:>4}  " + (f"{row.get('node') or '-':<8} " if nodes else "") +
                  f"{row['pid']:>7}  {row['state']:<9} {bytes_text(row['rss']):>9}  "
                  f"{bytes_text(row['gpu']):>9}  {row['cell'] or '-'}")

    def _push(self, args):
        session = self.state.session
        if session is None or not session.alive:
            raise UsageError(NO_SESSION)
        if not args.names:
            raise UsageError("push needs the names to send: `%distributed_session push lr epochs`.")
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"{', '.join(missing)} not defined in the notebook: nothing to push.")
        session.push_names(args.names)
        print(f"accel_magics: {', '.join(args.names)} now come(s) from the notebook: the next session cell that "
              "uses them gets the notebook's value.")


def _restarts_here(cfg, given: dict) -> None:
    """``--max_restarts`` of a session is the one given to it (a default of
    one-shot cells is not a session's); refused where one kernel holds one
    node's part only (each node's kernel would restart its own, alone)."""
    cfg.max_restarts = given.get("max_restarts") or 0
    if cfg.max_restarts and cfg.num_nodes > 1:
        raise UsageError("--max_restarts cannot be given to a session of one kernel per node (--num_nodes "
                         f"{cfg.num_nodes}): each node's kernel holds its own part, and one node's restart "
                         "alone cannot form a fresh world. Use --launcher slurm (one kernel restarts every "
                         "node), or `%distributed_session restart` on every node. Nothing was started.")


class _Args:
    """The launch options as DistributedMagics.launch_config reads them off parsed flags."""

    def __init__(self, given: dict) -> None:
        for name in LAUNCH_OPTION_NAMES:
            setattr(self, name, given.get(name))
