"""Incremental detokenization with stop strings (pure Python, no llama.cpp).

Tokens arrive one at a time as byte pieces; a piece may end in the middle of a UTF-8 character, and the
tail of the text may be the beginning of a stop string. :class:`TextStream` only releases text that is
final: complete characters that cannot become part of a stop string.

>>> s = TextStream(stop=["\\n\\n"])
>>> s.feed(b"Hello"), s.feed(b"\\n"), s.feed(b"\\n"), s.stopped
('Hello', '', '', True)
>>> s.text
'Hello'
"""
from __future__ import annotations

import codecs
from typing import Sequence


class TextStream:
    def __init__(self, stop: Sequence[str] = ()):  # noqa: D107
        self.stop = [s for s in stop if s]
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet released (could start a stop string)
        self._parts: list[str] = []  # released text, joined when read (no quadratic concatenation)
        self.stopped = False
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self._pending += self._dec.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release everything still held back (no stop string matched)."""
        if self.stopped:
            return ""
        self._pending += self._dec.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        buf = self._pending
        if self.stop:
            # earliest complete stop string
            best = -1
            for s in self.stop:
                i = buf.find(s)
                if i >= 0 and (best < 0 or i < best):
                    best, self.stop_string = i, s
            if best >= 0:
                out = buf[:best]
                self._parts.append(out)
                self._pending = ""
                self.stopped = True
                return out
            if not final:
                hold = 0
                for s in self.stop:
                    for k in range(min(len(s) - 1, len(buf)), 0, -1):
                        if buf.endswith(s[:k]):
                            hold = max(hold, k)
                            break
                out, self._pending = (buf[: len(buf) - hold], buf[len(buf) - hold :]) if hold else (buf, "")
                self._parts.append(out)
                return out
        self._pending = ""
        self._parts.append(buf)
        return buf
