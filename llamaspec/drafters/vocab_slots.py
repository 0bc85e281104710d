"""Run-time rows of a trimmed draft vocabulary (``models.trim``): tokens the trimmed draft does not keep get a
free row as soon as they are met.

A trimmed draft cannot propose a token it does not keep, and the tokens it misses are the ones that matter
in the text at hand: the names and rare words of the prompt, which the output repeats. The trimmed file
ends with free rows (source id -1). Before the draft decodes a batch, every token of the batch that is
neither kept nor already in a row is given one (least recently used first when none is free): its row of
the source draft's ``token_embd`` / ``output`` is copied into the loaded model's tensors
(``_llama.tensors``), and the id maps change. From then on the draft reads that token and can propose it
exactly as the whole-vocabulary draft would (its logit is the same dot product).

The model must be loaded without mmap (its tensors are written) and the source file must still be there,
unchanged in size; otherwise the slots stay off and the trimmed draft works with its fixed tokens.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from .. import _llama as llama
from .._llama.tensors import model_tensors, set_tensor, tensor_nbytes
from ..models.gguf_io import open_gguf
from ..models.trim import SOURCE_PATH_KEY, SOURCE_SIZE_KEY, VOCAB_TENSORS as _VOCAB_TENSORS

log = logging.getLogger("llamaspec")


class VocabSlots:
    """Assigns the free rows of a trimmed draft. ``to_tgt`` (draft id -> target id, -1 for a free row) and
    ``to_dft`` (target id -> draft id, -1 for a token without a row) are updated in place."""

    def __init__(self, tensors: list[tuple[int, np.ndarray, np.ndarray]], to_tgt: np.ndarray, to_dft: np.ndarray):
        #: per vocabulary tensor: (ggml_tensor *, the loaded rows [n_dft, row bytes], the source rows [n_src, row bytes])
        self._tensors = tensors
        self.to_tgt, self.to_dft = to_tgt, to_dft
        self._free = [int(i) for i in np.flatnonzero(to_tgt < 0)]
        self.n_slots = len(self._free)
        self._used: OrderedDict[int, int] = OrderedDict()  # target id -> draft row, least recently used first
        self.n_assigned = 0  #: rows filled so far (statistics)

    @classmethod
    def open(cls, model: llama.Model, to_tgt: np.ndarray, to_dft: np.ndarray) -> Optional["VocabSlots"]:
        """The slots of a loaded trimmed draft, or None (logged) where they cannot work."""
        if not np.any(to_tgt < 0):
            return None
        src = model.meta(SOURCE_PATH_KEY)
        size = model.meta(SOURCE_SIZE_KEY)
        why = None
        if getattr(model, "use_mmap", True):
            why = "the draft was loaded with mmap"
        elif not src or not Path(src).is_file():
            why = f"its source draft {src} is gone"
        elif size is not None and str(Path(src).stat().st_size) != size:
            why = f"its source draft {src} changed"
        ptrs = None if why else model_tensors(model.live_ptr())
        if why is None and ptrs is None:
            why = "this llama.cpp library's tensors cannot be written from Python"
        if why is not None:
            log.info("trimmed draft %s: run-time vocabulary rows are off: %s", model.path.name, why)
            return None
        n_dft, n_src = to_tgt.size, int(to_dft.size)
        tensors = []
        with open_gguf(model.path) as (lay, buf):
            mine = {t.name: t for t in lay.tensors}
            for name, ptr in ptrs:
                t = mine.get(name)
                if name not in _VOCAB_TENSORS or t is None or t.nbytes is None or tensor_nbytes(ptr) != t.nbytes:
                    continue
                rows = np.frombuffer(buf, np.uint8, t.nbytes, lay.data_start + t.offset).reshape(n_dft, -1).copy()
                tensors.append([name, ptr, rows])
        if not tensors:
            log.info("trimmed draft %s: run-time vocabulary rows are off: no vocabulary tensor found", model.path.name)
            return None
        out = []
        with open_gguf(src) as (lay, _):
            theirs = {t.name: t for t in lay.tensors}
            for name, ptr, rows in tensors:
                t = theirs.get(name)
                if t is None or t.nbytes is None or t.nbytes != rows.shape[1] * n_src:
                    log.info("trimmed draft %s: run-time vocabulary rows are off: %s differs in %s", model.path.name, name, src)
                    return None
                srows = np.memmap(src, np.uint8, "r", lay.data_start + t.offset, (n_src, rows.shape[1]))
                out.append((ptr, rows, srows))
        return cls(out, to_tgt, to_dft)

    def ensure(self, tokens: Iterable[int]) -> bool:
        """Give every token of ``tokens`` without a row one; True when rows changed (the caller refreshes what
        depends on the maps)."""
        arr = np.fromiter(tokens, dtype=np.int64)
        if arr.size == 0:
            return False
        arr = arr[(arr >= 0) & (arr < self.to_dft.size)]
        missing = np.unique(arr[self.to_dft[arr] < 0])
        for t in np.unique(arr[self.to_dft[arr] >= self.to_tgt.size - self.n_slots]):  # refresh their recency
            if int(t) in self._used:
                self._used.move_to_end(int(t))
        if missing.size == 0:
            return False
        batch = set(int(t) for t in arr)
        changed = []
        for t in missing[: self.n_slots].tolist():
            if self._free:
                row = self._free.pop()
            else:
                old = next((o for o in self._used if o not in batch), None)
                if old is None:
                    break
                row = self._used.pop(old)
                self.to_dft[old] = -1
            self._used[t] = row
            self.to_dft[t] = row
            self.to_tgt[row] = t
            changed.append((row, t))
        if not changed:
            return False
        for ptr, rows, srows in self._tensors:
            for row, t in changed:
                rows[row] = srows[t]
            set_tensor(ptr, rows)  # whole tensor: a repacked CPU buffer takes nothing less
        self.n_assigned += len(changed)
        return True
