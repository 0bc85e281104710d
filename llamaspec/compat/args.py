"""The constructor and request arguments of ``llama_cpp.Llama`` that :class:`~llamaspec.compat.llama.Llama`
does not implement: which are accepted with a warning, which are refused, and the message for a name
``llama_cpp.Llama`` does not have either (llama-cpp-python swallows those silently; the drop-in does not).
"""
from __future__ import annotations

import difflib
import warnings
from typing import Any

from ..errors import UsageError

__all__ = ["CompatError", "CompatWarning", "check_extra_kwargs", "check_request_args", "LLAMA_CPP_DEFAULTS"]


class CompatError(UsageError, ValueError):
    """An argument the drop-in refuses: a :class:`~llamaspec.errors.UsageError` that is also the
    ``ValueError`` code written for ``llama_cpp.Llama`` catches."""


class CompatWarning(UserWarning):
    """An argument of ``llama_cpp.Llama`` that ``llamaspec.Llama`` accepts but cannot honour."""


#: ``llama_cpp.Llama.__init__`` arguments that the drop-in takes as ``**kwargs``: name -> llama-cpp-python's
#: default. Passing the default is always fine; another value is warned about (WARN) or refused (REFUSE).
LLAMA_CPP_DEFAULTS: dict[str, Any] = {
    "use_mlock": False, "kv_overrides": None, "rope_scaling_type": -1, "pooling_type": -1,
    "attention_type": -1, "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0,
    "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0,
    "embedding": False, "offload_kqv": True, "op_offload": None, "swa_full": None, "no_perf": False,
    "lora_base": None, "lora_scale": 1.0, "lora_path": None, "numa": False, "tokenizer": None,
    "spm_infill": False,
    # not llama_cpp.Llama's any more, swallowed by its **kwargs: LangChain's LlamaCpp / ChatLlamaCpp always pass them
    "n_parts": -1, "f16_kv": True,
}
#: those whose other values would change what the model computes in a way llamaspec cannot follow
REFUSE = {"kv_overrides", "embedding", "lora_base", "lora_path", "tokenizer"}
#: those that only concern speed or memory, ``spm_infill`` (honoured by ``suffix``), the RoPE frequency base and
#: scale (honoured: the target context's, as llama_cpp.Llama's context gets them) and the old ``n_parts`` /
#: ``f16_kv`` that llama_cpp.Llama swallows: any value is accepted silently
SILENT = {"use_mlock", "numa", "no_perf", "swa_full", "op_offload", "offload_kqv", "spm_infill",
          "rope_freq_base", "rope_freq_scale", "n_parts", "f16_kv"}
#: every argument the drop-in's constructor names itself (for the "did you mean" of an unknown one)
OWN = ("model_path", "n_gpu_layers", "split_mode", "main_gpu", "tensor_split", "vocab_only", "use_mmap", "seed",
       "n_ctx", "n_batch", "n_ubatch", "n_threads", "n_threads_batch", "logits_all", "flash_attn",
       "last_n_tokens_size", "chat_format", "chat_handler", "draft_model", "type_k", "type_v", "verbose", "spec",
       "n_parallel", "verify", "n_gpu_layers_draft")


def check_extra_kwargs(kwargs: dict[str, Any]) -> None:
    """Validate the ``**kwargs`` of ``Llama(...)``: unknown names raise :class:`TypeError` (with a suggestion),
    unsupported non-default values raise :class:`UsageError` or warn (:class:`CompatWarning`)."""
    for name, value in kwargs.items():
        if name not in LLAMA_CPP_DEFAULTS:
            close = difflib.get_close_matches(name, list(OWN) + list(LLAMA_CPP_DEFAULTS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"llamaspec.Llama() got an unexpected keyword argument {name!r}{hint}")
        if value == LLAMA_CPP_DEFAULTS[name] or name in SILENT:
            continue
        if name in REFUSE:
            raise CompatError(f"llamaspec.Llama does not support {name}={value!r}; use llama_cpp.Llama for it "
                             "(optionally with draft_model=llamaspec.DraftModel(...))")
        warnings.warn(f"llamaspec.Llama ignores {name}={value!r} (the model's own value is used)", CompatWarning,
                      stacklevel=3)


def check_request_args(*, suffix: Any, mirostat_mode: Any) -> None:
    """Refuse, with one clear line each, completion arguments llama-cpp-python would choke on later."""
    if suffix is not None and not isinstance(suffix, str):
        raise CompatError(f"suffix must be a string or None, got {type(suffix).__name__}")
    if mirostat_mode not in (0, 1, 2):
        raise CompatError(f"mirostat_mode must be 0 (off), 1 or 2, got {mirostat_mode!r}")
