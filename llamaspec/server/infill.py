"""``POST /infill``: llama-server's fill-in-the-middle route (the one llama.vscode and other editor plugins
call), answered as ``/completion`` is (stream and not), through the same speculative engine.

Body: ``input_prefix`` and ``input_suffix`` (strings, or lists of strings and token ids; required),
``input_extra`` (optional: ``[{"filename": str, "text": str}]``, other files as context), ``prompt``
(optional: text that continues the prefix), plus every ``/completion`` field (``n_predict``, ``temperature``,
``stream``, ``speculative.*``, ...). The prompt is laid out as llama-server's ``format_prompt_infill`` does
(repository-level FIM, arXiv:2409.12186; the FIM part is :func:`llamaspec.fim_layout.fim_body`, shared with the
drop-in's ``suffix=``)::

    [FIM_REP]myproject\\n [FIM_SEP]filename\\n text ...  [FIM_SEP]filename\\n   (the extra context)
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]            (--spm-infill: suffix part first)

where the last ``3/4 n_batch`` tokens of the prefix and the first ``n_batch/4 - 2 - len(prompt)`` of the
suffix are kept, and the extra context fills what ``n_ctx - n_batch - 2 n_predict`` leaves (its last
tokens). Without ``FIM_SEP`` the extra chunks are separated by a ``--- snippet ---`` line; without
``FIM_REP`` there is no project line. A model without FIM prefix, suffix and middle tokens: 501, as
llama-server. Differs on purpose: a missing ``input_prefix`` / ``input_suffix`` or a non-string ``prompt``
is a 400 (llama-server answers 500, or ignores the prompt).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..fim_layout import fim_body
from .errors import invalid, not_supported
from .limits import Limits, check_chars
from .parsing import Body

if TYPE_CHECKING:  # pragma: no cover
    from .._llama.vocab import FimTokens
    from ..engine import Engine
    from .state import ServerConfig

__all__ = ["fim_prompt", "infill_parts", "infill_prompt", "require_fim"]

#: the separator of extra chunks for a model without FIM_SEP (llama-server's, in bytes there)
SNIPPET = "\n\n--- snippet ---\n\n"


def fim_prompt(fim: "FimTokens", tokenize: Callable[[str], list[int]], *, prefix: list[int], suffix: list[int],
               extra: Sequence[dict], prompt: list[int], n_batch: int, n_predict: int, n_ctx: int, spm: bool,
               bos: int | None) -> list[int]:
    """The infill prompt (module docstring): ``prefix`` / ``suffix`` / ``prompt`` as tokens, ``extra`` the
    checked ``input_extra`` chunks, ``tokenize`` text -> ids without special tokens, ``bos`` the BOS to put
    first (None: the model adds none).

    >>> from collections import namedtuple
    >>> F = namedtuple("F", "pre suf mid pad rep sep")
    >>> tok = lambda s: [ord(c) for c in s]
    >>> fim_prompt(F(1, 2, 3, -1, -1, -1), tok, prefix=[10, 11], suffix=[20], extra=[], prompt=[12],
    ...            n_batch=64, n_predict=-1, n_ctx=256, spm=False, bos=None)
    [1, 10, 11, 12, 2, 20, 3]
    >>> fim_prompt(F(1, 2, 3, -1, -1, -1), tok, prefix=[10, 11], suffix=[20], extra=[], prompt=[12],
    ...            n_batch=64, n_predict=-1, n_ctx=256, spm=True, bos=0)
    [0, 2, 20, 1, 10, 11, 12, 3]
    >>> fim_prompt(F(1, 2, 3, -1, 4, 5), tok, prefix=[10], suffix=[], extra=[{"text": "x"}], prompt=[],
    ...            n_batch=8, n_predict=-1, n_ctx=256, spm=False, bos=None)[:9]
    [4, 109, 121, 112, 114, 111, 106, 101, 99]
    """
    out: list[int] = []
    if fim.rep >= 0:
        out += [fim.rep, *tokenize("myproject\n")]
    for chunk in extra:
        if fim.sep >= 0:
            out += [fim.sep, *tokenize(chunk.get("filename", "tmp") + "\n")]
        else:
            out += tokenize(SNIPPET)
        out += tokenize(chunk.get("text", ""))
    if fim.sep >= 0:
        out += [fim.sep, *tokenize("filename\n")]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(out))
    body = fim_body(fim.pre, fim.suf, fim.mid, [*prefix[len(prefix) - n_prefix:], *prompt], suffix[:n_suffix],
                    spm=spm)
    return [*out[len(out) - n_extra:], *([bos] if bos is not None else []), *body]


def _text_or_mixed(b: Body, key: str) -> list:
    """``input_prefix`` / ``input_suffix``: a string, or a list of strings and token ids (llama-server's
    ``tokenize_mixed``); the parts as given."""
    v = b.data.get(key)
    if v is None:
        raise invalid(f"\"{key}\" is required")
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in v):
        return v
    raise invalid(f"Field '{key}': expected a string, or a list of strings and token ids")


def _extra(b: Body) -> list[dict]:
    v = b.data.get("input_extra")
    if v is None:
        return []
    if not isinstance(v, list):
        raise invalid("\"input_extra\" must be an array of {\"filename\": string, \"text\": string}")
    for chunk in v:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid("extra_context chunk must contain a \"text\" field with a string value")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise invalid("extra_context chunk's \"filename\" field must be a string")
    return v


def require_fim(eng: "Engine") -> None:
    """501 for a model without FIM prefix, suffix and middle tokens (before the body is read)."""
    fim = eng.vocab.fim
    if fim.missing:
        raise not_supported("Infill is not supported by this model: "
                            + "".join(f"{m} token is missing. " for m in fim.missing))


def infill_parts(b: Body, limits: Limits) -> tuple[list, list, list[dict], str]:
    """The request's parts, checked before anything is tokenised (400 naming what is wrong)."""
    prompt: Any = b.data.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid("\"prompt\" must be a string")
    prefix, suffix = _text_or_mixed(b, "input_prefix"), _text_or_mixed(b, "input_suffix")
    extra = _extra(b)
    n_chars = sum(len(x) for p in (prefix, suffix) for x in p if isinstance(x, str)) + len(prompt or "")
    n_chars += sum(len(c["text"]) + len(c.get("filename", "")) for c in extra)
    check_chars("input_prefix", n_chars, limits)
    return prefix, suffix, extra, prompt or ""


def infill_prompt(eng: "Engine", cfg: "ServerConfig", parts: tuple[list, list, list[dict], str]) -> list[int]:
    """The infill prompt of a request whose ``parts`` :func:`infill_parts` checked."""
    vocab = eng.vocab
    prefix, suffix, extra, prompt = parts

    def tok(text: str) -> list[int]:  # llama-server: no BOS, special tokens not parsed
        return eng.tokenize(text, add_special=False, parse_special=False)

    def tokens(parts: list) -> list[int]:
        return [t for x in parts for t in (tok(x) if isinstance(x, str) else [x])]

    return fim_prompt(vocab.fim, tok, prefix=tokens(prefix), suffix=tokens(suffix), extra=extra,
                      prompt=eng.tokenize(prompt, add_special=False, parse_special=True), n_batch=eng.ctx.n_batch,
                      n_predict=cfg.defaults.n_predict, n_ctx=eng.n_ctx_seq, spm=cfg.spm_infill,
                      bos=vocab.bos if vocab.add_bos and vocab.bos >= 0 else None)
