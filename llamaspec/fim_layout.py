"""The fill-in-the-middle token layout both faces share: llama-server's ``/infill``
(:mod:`llamaspec.server.infill`) and the drop-in's ``create_completion(suffix=...)``
(:mod:`llamaspec.compat.completion`)::

    [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]        (spm: [FIM_SUF] suffix [FIM_PRE] prefix [FIM_MID])

What differs between the faces stays with each of them, on purpose: llama-server truncates the prefix and
suffix to the batch, appends its ``prompt`` to the prefix and puts the repository context and BOS before the
layout; llama-cpp-python lays out the whole prompt and suffix and adds BOS / EOS around it as for any prompt.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["fim_body"]


def fim_body(pre: int, suf: int, mid: int, prefix: Sequence[int], suffix: Sequence[int], *,
               spm: bool) -> list[int]:
    """``prefix`` and ``suffix`` between the FIM tokens ``pre`` / ``suf`` / ``mid`` (module docstring); ``spm``:
    the suffix part first (llama.cpp's ``--spm-infill``).

    >>> fim_body(1, 2, 3, [10, 11], [20], spm=False)
    [1, 10, 11, 2, 20, 3]
    >>> fim_body(1, 2, 3, [10, 11], [20], spm=True)
    [2, 20, 1, 10, 11, 3]
    """
    head, tail = [pre, *prefix], [suf, *suffix]
    return [*tail, *head, mid] if spm else [*head, *tail, mid]
