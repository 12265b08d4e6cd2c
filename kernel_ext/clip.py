"""Text cut to a length where a person reads it: at a word or identifier
boundary, with an ellipsis, never inside ``DistributedDataParallel``."""
from __future__ import annotations

import re

ELLIPSIS = "…"
#: How far from the limit a space is preferred to any other boundary (a
#: fraction of the limit): "rank 1 failed: …" rather than "rank 1 failed: torch.…".
_SPACE_REACH = 0.3
_WORD = re.compile(r"\w")


def _splits(text: str, i: int) -> bool:
    """Whether cutting ``text`` at ``i`` splits a word or an identifier."""
    return 0 < i < len(text) and bool(_WORD.match(text[i - 1])) and bool(_WORD.match(text[i]))


def clip(text: str, limit: int, keep: str = "head") -> str:
    """``text`` when it fits ``limit`` characters; else its head (or with
    ``keep="tail"`` its tail) cut where no word is split, the ellipsis where
    the rest was.  A single token longer than the limit (a hash) is cut at it."""
    if len(text) <= limit:
        return text
    room = max(1, limit - len(ELLIPSIS))
    reach = int(room * _SPACE_REACH)
    if keep == "tail":
        start = len(text) - room
        space = text.find(" ", start, start + reach)
        cut = space + 1 if space >= 0 else next((i for i in range(start, len(text)) if not _splits(text, i)), start)
        return ELLIPSIS + text[cut:].lstrip()
    space = text.rfind(" ", room - reach, room + 1)
    cut = space if space > 0 else next((i for i in range(room, 0, -1) if not _splits(text, i)), room)
    return text[:cut].rstrip() + ELLIPSIS
