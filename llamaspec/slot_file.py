"""llama-server's slot files (``POST /slots/{id}?action=save|restore``): the token list and the file names.

A slot file is what llama.cpp's ``llama_state_seq_save_file`` writes (:mod:`llamaspec._llama.state_file`):
three 32-bit words (the magic ``ggsq``, the sequence-state version, the number ``n`` of token words), ``n``
token words, then the sequence state. llama-server packs its token list into those words: ``-1``
(``LLAMA_TOKEN_NULL``), the format version 1, the token count, the tokens, then the number of media chunks
(0 for text) and the chunks. Files written by older servers hold the plain token list instead (its first word
is a token, never -1): both are read. So llamaspec and llama-server read each other's files (the state itself
must come from the same model and context settings).

>>> words = pack_tokens([5, 6, 7])
>>> words
[-1, 1, 3, 5, 6, 7, 0]
>>> unpack_tokens(words), unpack_tokens([5, 6, 7])
([5, 6, 7], [5, 6, 7])
>>> unpack_tokens([-1, 1, 1, 5, 1, 0, 8])
Traceback (most recent call last):
...
llamaspec.slot_file.SlotFileError: Cannot restore media tokens without an mmproj
"""
from __future__ import annotations

from typing import Sequence

from .errors import UsageError

__all__ = ["SlotFileError", "pack_tokens", "unpack_tokens", "valid_filename"]

TOKENS_VERSION = 1  # llama-server's packed token list
TOKEN_NULL = -1


class SlotFileError(UsageError):
    """A slot file that cannot be restored (llama-server answers 400 ``Unable to restore slot: ...``)."""


def pack_tokens(tokens: Sequence[int]) -> list[int]:
    """llama-server's packed token list (no media): ``[-1, 1, n, *tokens, 0]``."""
    return [TOKEN_NULL, TOKENS_VERSION, len(tokens), *tokens, 0]


def unpack_tokens(words: Sequence[int]) -> list[int]:
    """The tokens of a packed list, or of a plain one (written by older llama-servers)."""
    if not words or words[0] != TOKEN_NULL:
        return list(words)
    if len(words) < 3:
        raise SlotFileError("Server tokens state is truncated")
    if words[1] != TOKENS_VERSION:
        raise SlotFileError("Unsupported server tokens state version")
    n = words[2] & 0xFFFFFFFF
    if len(words) < 4 + n:
        raise SlotFileError("Server tokens state is truncated")
    tokens = list(words[3:3 + n])
    if words[3 + n] != 0:
        raise SlotFileError("Cannot restore media tokens without an mmproj")
    if len(words) > 4 + n:
        raise SlotFileError("Trailing data in server tokens state")
    return tokens


_FORBIDDEN = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


def valid_filename(name: str) -> bool:
    """llama-server's rule for a slot file name (``fs_validate_filename``): 1..255 UTF-8 bytes, no control
    characters, path separators, ``: * ? " < > |`` or their look-alikes, no ``..``, not ``.``, no leading or
    trailing space nor trailing dot.

    >>> [valid_filename(n) for n in ("slot1.bin", "../x", "a/b", "", ".", "x.", " x", "a\\x00b", "ok name")]
    [True, False, False, False, False, False, False, False, True]
    """
    if not name or name == "." or ".." in name or name[0] == " " or name[-1] in " .":
        return False
    try:
        if len(name.encode("utf-8")) > 255:
            return False
    except UnicodeEncodeError:  # a lone surrogate
        return False
    for c in name:
        o = ord(c)
        if o <= 0x1F or o == 0x7F or 0x80 <= o <= 0x9F or c in _FORBIDDEN:
            return False
    return True
