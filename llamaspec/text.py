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
import time
from typing import Sequence


class TextStream:
    """See the module docstring. ``n_indent`` and ``t_max_predict_ms`` are llama-server's line limits (for
    FIM): a line indented less than ``n_indent`` ends the text before its first character, and once
    ``t_max_predict_ms`` have passed since the first token the next token with a newline ends it; either
    sets :attr:`limited` (a ``length`` finish, not a stop string)."""

    def __init__(self, stop: Sequence[str] = (), *, n_indent: int = 0, t_max_predict_ms: int = 0):  # noqa: D107
        self.stop = [s for s in stop if s]
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded text not yet released (could start a stop string)
        self._parts: list[str] = []  # released text, joined when read (no quadratic concatenation)
        self.stopped = False
        self.limited = False
        self.stop_string: str | None = None
        self.n_indent, self.t_max_predict_ms = n_indent, t_max_predict_ms
        self._lines = n_indent > 0 or t_max_predict_ms > 0
        self._has_new_line, self._last_nl, self._t0 = False, 0, None
        self._tail, self._base = "", 0  # the text from position _base on (n_indent)

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
        new = self._dec.decode(piece)
        self._pending += new
        out = self._release(final=False)
        if self._lines and not self.stopped:
            self._line_limits(new)
        return out if not self.limited else ""

    def _line_limits(self, new: str) -> None:
        """llama-server's order: the indentation of the line after the last newline seen, then the time limit
        on a token with a newline. Only the text from that newline on is kept (``_tail``, starting at
        ``_base`` of the whole text), so a long output costs nothing per token."""
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self.n_indent > 0:
            self._tail += new
        if self._has_new_line and self.n_indent > 0:
            tail, start = self._tail, self._last_nl - self._base
            if self._last_nl > 0:
                pos = start
                while pos < len(tail) and tail[pos] in " \t":
                    pos += 1
                if pos < len(tail) and pos - start < self.n_indent:
                    self._cut((self.text + self._pending)[: self._base + pos])
                    return
            nl = tail.find("\n", start)
            if nl >= 0:
                self._last_nl = self._base + nl + 1
                self._tail, self._base = tail[nl + 1:], self._last_nl
        if "\n" in new:
            self._has_new_line = True
            if self.t_max_predict_ms > 0 and (time.perf_counter() - self._t0) * 1e3 > self.t_max_predict_ms:
                self._cut(self.text + self._pending)

    def _cut(self, text: str) -> None:
        self._parts[:] = [text]
        self._pending = ""
        self.stopped = self.limited = True

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
