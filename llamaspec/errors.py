"""Typed errors raised by the library. The CLI turns each into one clear line.

Every error carries a message that says what went wrong and what to do about it.
"""
from __future__ import annotations


class LlamaSpecError(Exception):
    """Base class of every error llamaspec raises on purpose."""

    #: process exit code the CLI uses: 2 for usage errors, 1 for runtime errors
    exit_code = 1


class UsageError(LlamaSpecError):
    """The caller asked for something invalid (bad flag value, bad parameter)."""

    exit_code = 2


class ModelNotFoundError(UsageError):
    """A model name is not in models.toml and is not a path to an existing file."""


class ModelFormatError(LlamaSpecError):
    """A file is not a GGUF file, is truncated, or llama.cpp refused to load it."""


class FetchError(LlamaSpecError):
    """Downloading or deriving a model failed (offline, checksum mismatch, disk full)."""


class ContextError(LlamaSpecError):
    """llama.cpp could not create a context with the requested parameters."""


class DecodeError(LlamaSpecError):
    """llama_process / llama_decode returned a non-zero status."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class OutputLimitError(LlamaSpecError):
    """A batch asks for more output rows than the context allows (llama.cpp would abort the process)."""


class ContextOverflowError(UsageError):
    """The prompt (plus what must be generated) does not fit the context window."""


class MemoryOpError(LlamaSpecError):
    """A memory operation (seq_rm, state load) failed where it must succeed."""


class StateError(LlamaSpecError):
    """Saving or loading a sequence state failed or the sizes did not match."""


class VocabMismatchError(UsageError):
    """Draft and target vocabularies are incompatible (§11)."""


class SamplerError(LlamaSpecError):
    """A sampler could not be built (e.g. a grammar that does not parse)."""


class EngineClosedError(LlamaSpecError):
    """The Engine was closed; create a new one."""


class RequestError(LlamaSpecError):
    """A request finished with an error (its message says which); the engine and other requests go on."""


class RpcError(LlamaSpecError):
    """An RPC server (llama.cpp's ggml-rpc-server) is unreachable, speaks another protocol, or failed."""
