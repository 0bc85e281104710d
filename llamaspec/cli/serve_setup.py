"""``llamaspec serve``'s flags -> settings: each check gives one clear :class:`~llamaspec.errors.UsageError` line
(exit 2) for a bad value, as llama-server's parser refuses it."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from llamaspec.errors import UsageError

from .server_compat import FALSE, TRUE

__all__ = ["read_api_keys", "chat_template_arg", "flash_attn_arg", "kv_f32_arg", "n_parallel_arg", "ctx_size_arg",
           "apply_logging", "model_sources", "server_config", "comma_list", "slot_options", "pop_slot_options"]

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
#: ``-np -1`` (auto): llama-server's choice
AUTO_N_PARALLEL = 4
#: ``-c 0``: a size the engine clamps to the model's training context
FROM_MODEL_N_CTX = 1 << 30


def comma_list(v: str | None) -> list[str]:
    return [s.strip() for s in (v or "").split(",") if s.strip()]


def _read(flag: str, path: str) -> str:
    """The text of the file a flag names, or a UsageError naming the flag."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{flag}: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {path}: {e}") from None


def read_api_keys(keys: tuple[str, ...], key_file: str | None) -> list[str]:
    """``--api-key`` (repeatable, comma lists) and ``--api-key-file`` (one key per line; ``#`` comments)."""
    out = [k for arg in keys for k in comma_list(arg)]
    if key_file is not None:
        lines = _read("--api-key-file", key_file).splitlines()
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not file_keys:
            raise UsageError(f"--api-key-file: {key_file} holds no key (one key per line)")
        out += file_keys
    return out


def chat_template_arg(name: str | None, file: str | None) -> str | None:
    if name is not None and file is not None:
        raise UsageError("give --chat-template or --chat-template-file, not both")
    return _read("--chat-template-file", file) if file is not None else name


def flash_attn_arg(v: str) -> bool | None:
    """``-fa on|off|auto`` (and llama.cpp's other spellings: 1/0, true/false, enabled/disabled, -1)."""
    s = v.strip().lower()
    if s in TRUE:
        return True
    if s in FALSE:
        return False
    if s in ("auto", "-1"):
        return None
    raise UsageError(f"-fa / --flash-attn: expected on, off or auto, got {v!r}")


def kv_f32_arg(k: str, v: str, notes: list[str]) -> bool:
    """``-ctk`` / ``-ctv``: f16 (the default) or f32 for both; the quantized types are accepted with a note."""
    for flag, t in (("-ctk", k), ("-ctv", v)):
        if t.lower() not in KV_TYPES:
            raise UsageError(f"{flag}: unknown KV cache type {t!r} (allowed: {', '.join(KV_TYPES)})")
    k, v = k.lower(), v.lower()
    if k == v == "f32":
        return True
    if (k, v) != ("f16", "f16"):
        notes.append(f"-ctk {k} -ctv {v}: llamaspec's KV cache is F16 (or F32 with -ctk f32 -ctv f32): using F16")
    return False


def n_parallel_arg(n: int) -> int:
    if n == 0:
        raise UsageError("-np / --parallel: expected a number of slots >= 1, or -1 for auto")
    return AUTO_N_PARALLEL if n < 0 else n


def ctx_size_arg(n: int) -> int:
    if 0 < n < 16:
        raise UsageError(f"-c / --ctx-size: expected 0 (the model's) or at least 16 tokens, got {n}")
    return FROM_MODEL_N_CTX if n == 0 else n


def apply_logging(verbose: int, verbosity: int | None, log_file: str | None, disable: bool) -> int:
    """``-v`` / ``-lv N`` / ``--log-file`` / ``--log-disable`` on llamaspec's logging; the verbosity in effect."""
    from ._common import CliState, check_output_path, setup_logging

    level = max(CliState.verbose, verbose)
    if verbosity is not None:
        level = 2 if verbosity >= 4 else level
    if disable:
        level = 0
    if level != CliState.verbose:
        CliState.verbose = level
        setup_logging(level, CliState.debug)
    if disable:
        logging.getLogger("llamaspec").setLevel(logging.CRITICAL + 1)
    elif verbosity is not None and verbosity <= 1:
        logging.getLogger("llamaspec").setLevel(logging.ERROR)
    if log_file:
        check_output_path(log_file, "--log-file")
        h = logging.FileHandler(log_file, encoding="utf-8")
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in ("llamaspec", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).addHandler(h)
    return level


def model_sources(model: str | None, draft: str | None, *, model_url: str | None = None, hf_repo: str | None = None,
                  hf_file: str | None = None, hf_token: str | None = None, hf_repo_draft: str | None = None,
                  cache_dir: str | None = None, offline: bool = False) -> tuple[str | None, str | None]:
    """``-m`` / ``-mu`` / ``-hf`` and ``-md`` / ``-hfd`` -> (target, draft) as ``-m`` / ``-md`` take them; with
    ``--offline`` models.toml names resolve to their cached files only."""
    from . import serve_models

    given = [f for f, v in (("-m", model), ("-mu", model_url), ("-hf", hf_repo)) if v]
    if len(given) > 1:
        raise UsageError(f"give one of {' / '.join(given)} for the model, not several")
    if hf_file and not hf_repo:
        raise UsageError("-hff names a file of -hf USER/MODEL: add -hf")
    if hf_repo_draft and draft:
        raise UsageError("give -md or -hfd for the draft model, not both")
    if model_url:
        model = serve_models.url_model(model_url, cache_dir=cache_dir, offline=offline)
    elif hf_repo:
        model = serve_models.hf_model(hf_repo, hf_file, token=hf_token, cache_dir=cache_dir, offline=offline)
    elif offline:
        model = serve_models.resolve_offline(model, cache_dir)
    if hf_repo_draft:
        draft = serve_models.hf_model(hf_repo_draft, None, token=hf_token, cache_dir=cache_dir, offline=offline,
                                      flag="-hfd")
    elif offline:
        draft = serve_models.resolve_offline(draft, cache_dir)
    return model, draft


def server_config(*, model: str | None, path: str, alias: str | None, tags: str | None, defaults: dict,
                  cors: tuple, **kw):
    """The :class:`~llamaspec.server.state.ServerConfig`: the model's names (``-a`` a comma list: the first in
    alphabetical order is the id, as llama-server), tags, CORS and the rest as given."""
    from llamaspec.server.parsing import Defaults
    from llamaspec.server.state import ServerConfig

    aliases = sorted(set(comma_list(alias)))
    model_id = aliases[0] if aliases else (model or Path(path).stem)
    origins, methods, headers, credentials = cors
    return ServerConfig(model_id=model_id, model_path=path, aliases=aliases or [model_id],
                        tags=sorted(set(comma_list(tags))), api_keys=kw.pop("keys"), chat_template=kw.pop("template"),
                        cors_origins=origins, cors_methods=methods, cors_headers=headers, cors_credentials=credentials,
                        defaults=Defaults(**defaults), **kw)


def slot_options(f):
    """Decorator adding ``--slot-save-path DIR`` (``POST /slots/{id}?action=save|restore`` files live there; without
    it the route answers 501, as llama-server) and ``--spm-infill`` (``/infill`` prompts in suffix/prefix/middle
    order), with llama-server's meaning."""
    f = click.option("--spm-infill", "spm_infill", is_flag=True,
                     help="Infill prompts in Suffix/Prefix/Middle order instead of Prefix/Suffix/Middle (some models "
                          "prefer it).")(f)
    return click.option("--slot-save-path", "slot_save_path", default=None, metavar="DIR",
                        help="Directory of the slot files of POST /slots/{id}?action=save|restore (default: disabled, "
                             "501).")(f)


def pop_slot_options(kw: dict) -> dict:
    """Take the two flags out of ``kw`` (the command's keyword arguments): ``ServerConfig`` keywords. A
    ``--slot-save-path`` that is not a directory is a usage error, as in llama-server."""
    path, spm = kw.pop("slot_save_path", None), bool(kw.pop("spm_infill", False))
    if path is not None and not os.path.isdir(path):
        raise UsageError(f"--slot-save-path: not a directory: {path}")
    return {"slot_save_path": os.path.abspath(path) if path is not None else None, "spm_infill": spm}
