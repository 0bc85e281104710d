"""The ctypes boundary: the only package that imports ``llama_cpp``.

Thin, owning wrappers over llama-cpp-python's low-level bindings. Every wrapper frees its native object
in ``close()`` (also called by ``__exit__`` and, as a last resort, ``__del__``), every llama.cpp return
code is checked and turned into a typed :mod:`llamaspec.errors` exception, and a call on a closed wrapper
raises :class:`~llamaspec.errors.LlamaSpecError` instead of handing a NULL pointer to C.

* :mod:`.log` - backend start-up, llama.cpp's log lines routed into ``logging``
* :mod:`.model` - :class:`Model`, :class:`Vocab` (and the lifetime rules between the wrappers)
* :mod:`.context` - :class:`Context`, :class:`Row`, :func:`output_limits`, :func:`chunks`; :mod:`.kv_memory` -
  :class:`Memory` (a context's sequence operations); :mod:`.token_batch` - the hot loop's token batch
* :mod:`.sampler` - :class:`SamplingParams`, :class:`Sampler`; :mod:`.sampler_chain` - llama.cpp's sampler order
* :mod:`.ext` - the staging (``llama-ext.h``) functions of the draft heads, bound by exported name
* :mod:`.json_schema` - :func:`json_schema_to_grammar` (JSON schema -> GBNF, llama-server's converter; llama-cpp-python's on request)
* :mod:`.state_file` - sequence-state files (llama-server's slot files)
* :mod:`.rpc` - llama.cpp's RPC backend (``ggml-rpc-server`` devices for model loading), bound by name

Callers use the package as one namespace (``from llamaspec import _llama as llama; llama.Context(...)``). Chat
templates are rendered by :mod:`llamaspec.chat`.
"""
from __future__ import annotations

from .context import (
    CONTEXT_TYPE_MTP,
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    PROCESS_ENCODE,
    STATE_FLAGS_NONE,
    STATE_FLAGS_PARTIAL_ONLY,
    Context,
    ContextParams,
    Row,
    chunks,
    default_threads,
    output_limits,
)
from .json_schema import chat_schema_grammar, json_schema_to_grammar
from .kv_memory import Memory
from .model import TOKEN_NULL, Model, Vocab, render_builtin_chat_template, supports_gpu_offload
from .threads import ThreadTuner
from .sampler import DEFAULT_SEED, Candidates, Sampler, SamplingParams
from .sampler_chain import DEFAULT_ORDER as SAMPLER_ORDER, picks_in_chain, sampler_order
from .state_file import seq_load_file, seq_save_file
from . import rpc

__all__ = [
    "supports_gpu_offload",
    "ThreadTuner",
    "Candidates",
    "SAMPLER_ORDER",
    "picks_in_chain",
    "sampler_order",
    "CONTEXT_TYPE_MTP",
    "DEFAULT_SEED",
    "GGML_TYPE_F16",
    "GGML_TYPE_F32",
    "PROCESS_ENCODE",
    "STATE_FLAGS_NONE",
    "STATE_FLAGS_PARTIAL_ONLY",
    "TOKEN_NULL",
    "Context",
    "ContextParams",
    "Memory",
    "Model",
    "Row",
    "Sampler",
    "SamplingParams",
    "Vocab",
    "chunks",
    "default_threads",
    "json_schema_to_grammar",
    "chat_schema_grammar",
    "output_limits",
    "render_builtin_chat_template",
    "rpc",
    "seq_load_file",
    "seq_save_file",
]

# doctest.testmod("llamaspec._llama") only looks at objects defined in this module: name the worked examples
__test__ = {"chunks": chunks, "output_limits": output_limits}
