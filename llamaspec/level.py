"""The rollback level of a context's memory (§6.1): core vocabulary of the engine and the rollback objects.

Numeric values as llama.cpp's ``common_context_seq_rm_type``:

* ``NO``   – the context has no memory (encoders); no speculation possible.
* ``PART`` – ``seq_rm`` can drop a tail of positions (KV caches, SWA): rejected drafts are trimmed.
* ``FULL`` – only whole sequences can be removed (recurrent / hybrid state): checkpoint + restore + replay.
* ``RS``   – recurrent state with ``n_rs_seq`` snapshots: bounded trim of up to ``n_rs_seq`` tokens.

The level is measured once per context by :func:`llamaspec.probe.can_seq_rm`.
"""
from __future__ import annotations

import enum

__all__ = ["Level"]


class Level(enum.IntEnum):
    NO = 0
    PART = 1
    FULL = 2
    RS = 3

    def __str__(self) -> str:
        return self.name
