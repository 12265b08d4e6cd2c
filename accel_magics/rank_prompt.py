"""The notebook's input box as a rank's stdin (kernel_ext/rank/rank_stdin.py).

:func:`ask` is what the engine calls (``execute(ask=...)``) when a rank of a
cell the kernel is running reads its stdin: the question is asked as
``input()`` asks it in an ordinary cell, through the Jupyter stdin channel,
with the prompt tagged by the rank (``(Pdb rank 1)``).  A frontend that takes
no input (nbconvert, papermill, nbval: ``allow_stdin`` off) gets end of input,
said once in the cell's output.
"""
from __future__ import annotations

import builtins
import sys

from accel_magics.kernel_ext.kernel.events import DEBUGGER_PROMPT


def tagged(prompt: str, rank: int) -> str:
    """``prompt`` as the input box shows it: a debugger's ``(Pdb) `` becomes
    ``(Pdb rank 1) ``; any other is led by ``[rank 1] ``."""
    found = DEBUGGER_PROMPT.fullmatch(prompt)
    if found:
        return f"({found.group(1)} rank {rank}) "
    return f"[rank {rank}] {prompt}"


def show(rank: int, text: str) -> None:
    """A rank's output outside its cell (a post-mortem's), as the text view shows a rank's lines."""
    sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    sys.stdout.flush()


def ask(rank: int, prompt: str) -> str:
    """The line the user types for ``rank``; EOFError when there is no one to type it."""
    from IPython.core.error import StdinNotImplementedError

    try:
        return builtins.input(tagged(prompt, rank))
    except StdinNotImplementedError:
        why = ("this frontend takes no input (allow_stdin is off, as under nbconvert, papermill and nbval), "
               "so the rank read end of input")
        print(f"accel_magics: rank {rank} asked for input ({prompt.strip() or 'no prompt'}); {why}",
              file=sys.stderr, flush=True)
        raise EOFError(why) from None
