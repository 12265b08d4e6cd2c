"""``%distributed_debug``: a post-mortem (pdb) of a failed rank, as IPython's
``%debug`` is of a failed cell.

After a ``%%distributed`` cell in which a rank failed, that rank is held as it
failed (``--debug_hold`` seconds, kernel_ext/rank/held.py) and the cell's
error says so.  ``%distributed_debug`` opens pdb's post-mortem in the
root-cause rank's failing frame (``--rank N``: another failed rank), its
prompt in the notebook's input box, tagged ``(Pdb rank 1)``; ``q`` ends it
and the rank.  The next ``%%distributed`` cell lets a held rank go.
"""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from accel_magics.kernel_ext.kernel import post_mortem

from . import rank_prompt
from .magics import parse_options


@magics_class
class DebugMagics(Magics):
    def __init__(self, shell, state) -> None:
        super().__init__(shell)
        self.state = state   # the kernel's launcher and the last failed run's held ranks (state.MagicsState)

    @magic_arguments()
    @argument("--rank", type=int, default=None, metavar="N",
              help="The failed rank to inspect (default: the root cause's).")
    @argument("--release", action="store_true",
              help="Let the held ranks go now, without a post-mortem (their memory, GPU memory too).")
    @line_magic
    def distributed_debug(self, line: str):
        """Open a post-mortem (pdb) in a failed rank's failing frame, after a
        ``%%distributed`` cell that failed, as ``%debug`` does after an
        ordinary cell: ``p``, ``pp``, ``w``, ``u``, ``d``, ``l`` work in its
        frames; ``q`` ends it and the rank.  Its prompt is the notebook's
        input box.  The rank is held for ``--debug_hold`` seconds after its
        failure, until the next ``%%distributed`` cell (``--release``: now)."""
        args = parse_options(self.distributed_debug, line)
        if args.release:
            self.state.release_held()
            return
        held = self.state.held
        if held is None or not held.alive():
            self.state.held = None
            raise UsageError("no failed rank is held for a post-mortem: a rank is held after a %%distributed cell "
                             "in which it failed, for --debug_hold seconds (0: never), until the next "
                             "%%distributed cell or its post-mortem's end.")
        rank = held.default_rank() if args.rank is None else args.rank
        if rank not in held.ranks:
            raise UsageError(f"rank {rank} is not held; held: {', '.join(map(str, sorted(held.ranks)))}.")
        try:
            end = post_mortem.debug(held, rank, rank_prompt.ask, rank_prompt.show)
        finally:
            if not held.ranks:
                self.state.held = None
        if end.get("gone"):
            print(f"accel_magics: rank {rank} was no longer held (its hold had ended).", flush=True)
        else:
            print(f"accel_magics: {held.ended(rank)}", flush=True)
