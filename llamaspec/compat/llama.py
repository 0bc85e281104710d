"""``llamaspec.Llama``: the ``llama_cpp.Llama`` interface over llamaspec's :class:`~llamaspec.engine.Engine`.

Code written for llama-cpp-python runs with one changed import::

    from llamaspec import Llama
    llm = Llama("target.gguf", draft_model="draft.gguf", n_ctx=2048)
    print(llm("Q: name the planets. A:", max_tokens=64)["choices"][0]["text"])
    llm.create_chat_completion(messages=[...], response_format={"type": "json_object", "schema": {...}})

The constructor takes llama-cpp-python's arguments with its defaults (``n_ctx=512``, CPU only unless
``n_gpu_layers``, half the cores for generation), plus llamaspec's own: ``draft_model`` (a GGUF path, a name
from models.toml, a :class:`~llamaspec.compat.draft.DraftModel`, a llamaspec
:class:`~llamaspec.drafters.base.Drafter`, or any llama-cpp-python ``LlamaDraftModel`` such as
``LlamaPromptLookupDecoding``), ``spec`` (:class:`~llamaspec.params.SpecParams`), ``verify`` (``"match"`` or
``"rejection"``) and ``n_parallel`` (concurrent completions from several threads, each with ``n_ctx``).
Other llama-cpp-python arguments are accepted, warned about or refused by :mod:`.args` (``rope_freq_base`` /
``rope_freq_scale`` are honoured; LangChain's ``n_parts`` / ``f16_kv`` are accepted silently, as llama_cpp.Llama
does); a name neither knows is a ``TypeError``.

Completions and chats sample at llama-cpp-python's defaults (temperature 0.8, top-p 0.95, top-k 40, min-p
0.05; chats at 0.2) and return its dictionaries; chats go through llama-cpp-python's own chat handlers
(:mod:`.chat`). ``logprobs`` (and the chats' ``logprobs`` / ``top_logprobs``) are the target model's, as
llama-cpp-python reports them, without its ``logits_all=True``; with ``echo=True`` the prompt's come from a
second decode (:mod:`.scoring`). :mod:`.completion` says how ``suffix``, ``logits_processor`` (every verified
row, in order), ``stopping_criteria``, ``typical_p``, mirostat and ``set_cache`` are served. The token-level
API (``eval``, ``sample``, ``generate``, ``n_tokens``, ``input_ids``, ``scores``, ``ctx``) is
:mod:`.lowlevel`'s. ``save_state``/``load_state`` save and restore every slot's prompt cache (:mod:`.state`).

Not served: embeddings (``embedding=True``, ``embed``, ``create_embedding``: a clear error, use
``llama_cpp.Llama``), LoRA adapters, ``kv_overrides``, multimodal chat handlers (those that drive llama.cpp
themselves), ``tfs_z`` (accepted and unused, as in llama-cpp-python 0.3.36).
"""
from __future__ import annotations

import os
from typing import Any, Iterator, List, Optional, Sequence

from .. import _llama as llama
from .._llama import compat as lcp
from ..params import SpecParams
from .args import CompatError, CompatWarning, check_extra_kwargs, check_request_args
from .chat import ChatHandlers
from .completion import check_logprobs, completion_chunks, sampling_params
from .drafter import model_file, resolve_draft
from .lowlevel import TokenAPI

__all__ = ["Llama"]


class Llama(TokenAPI):
    """See the module docstring. Attributes read by llama-cpp-python's chat handlers are provided
    (``verbose``, ``metadata``, ``chat_format``, ``model_path``, ``tokenize``, ``detokenize``...)."""

    def __init__(
        self,
        model_path: "str | os.PathLike",
        *,
        n_gpu_layers: int = 0,
        split_mode: int = 1,
        main_gpu: int = 0,
        tensor_split: "Sequence[float] | None" = None,
        vocab_only: bool = False,
        use_mmap: bool = True,
        seed: int = lcp.DEFAULT_SEED,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        n_threads: "int | None" = None,
        n_threads_batch: "int | None" = None,
        logits_all: bool = False,
        flash_attn: bool = False,
        last_n_tokens_size: int = 64,
        chat_format: "str | None" = None,
        chat_handler: Any = None,
        draft_model: Any = None,
        type_k: "int | None" = None,
        type_v: "int | None" = None,
        verbose: bool = True,
        spec: "SpecParams | None" = None,
        verify: str = "match",
        n_parallel: int = 1,
        n_gpu_layers_draft: "int | None" = None,
        **kwargs: Any,
    ):
        self._engine = None
        self._owned_model: "llama.Model | None" = None
        check_extra_kwargs(kwargs)
        self.verbose = verbose
        self.model_path = str(model_path)
        self._seed = seed or lcp.DEFAULT_SEED
        self.spm_infill = bool(kwargs.get("spm_infill", False))
        self.last_n_tokens_size = last_n_tokens_size
        self._logits_all = logits_all
        self._cache_ok = True
        self._last_report: "dict | None" = None
        self._last_tokens: "tuple[list[int], list[int]] | None" = None
        self.draft_model = draft_model
        path = model_file(model_path, lambda e: f"Model path does not exist: {model_path}")
        cpus = os.cpu_count() or 1
        ngl = -1 if n_gpu_layers == -1 else n_gpu_layers
        placement = dict(main_gpu=main_gpu or None, split_mode=lcp.split_mode_name(split_mode),
                         tensor_split=list(tensor_split) if tensor_split is not None else None)
        model = llama.Model(path, n_gpu_layers=ngl, use_mmap=use_mmap, vocab_only=vocab_only, **placement)
        # llama_cpp.Llama hands these to its context (0: the model's own)
        model.context_params.update({k: float(kwargs[k]) for k in ("rope_freq_base", "rope_freq_scale")
                                     if kwargs.get(k)})
        self._owned_model = model
        self._model = model
        self._vocab = model.vocab
        #: llama_cpp.Llama's tokenizer (outlines' from_llamacpp reads the vocabulary through it)
        self.tokenizer_ = LlamaTokenizer(self)
        self._special = lcp.special_tokens(model)
        self.metadata = lcp.metadata(model)
        if n_ctx == 0:
            n_ctx = model.n_ctx_train or 512
        self.n_batch = min(n_ctx, n_batch)
        self._n_ctx = n_ctx
        self.n_threads = n_threads or max(cpus // 2, 1)
        self.n_threads_batch = n_threads_batch or cpus
        kv_f32 = self._kv_f32(type_k, type_v)
        self.chat_format = chat_format
        self.chat_handler = chat_handler
        self._chats = ChatHandlers(self)
        self.chat_format = self._chats.default_format(chat_format, chat_handler)
        if vocab_only:
            return
        from ..engine import Engine

        try:
            draft, drafters, spec = resolve_draft(draft_model, spec, n_parallel)
            self._engine = Engine(model, draft=draft, drafters=drafters, spec=spec, verify=verify,
                                  n_ctx=n_ctx * n_parallel, n_parallel=n_parallel, n_batch=self.n_batch,
                                  n_ubatch=min(self.n_batch, n_ubatch),
                                  # none given: each decode's thread count is measured (llamaspec._llama.threads),
                                  # not llama_cpp.Llama's fixed cpus // 2 and cpus (2 threads lose on a busy box)
                                  n_threads=n_threads, n_threads_batch=n_threads_batch,
                                  flash_attn=bool(flash_attn), kv_f32=kv_f32,
                                  n_gpu_layers_draft=ngl if n_gpu_layers_draft is None else n_gpu_layers_draft,
                                  cache_prompt=True)
        except BaseException:
            self.close()
            raise
        self._n_ctx = self._engine.n_ctx_seq

    @staticmethod
    def _kv_f32(type_k: "int | None", type_v: "int | None") -> bool:
        kinds = {t for t in (type_k, type_v) if t is not None}
        if not kinds or kinds == {lcp.GGML_TYPE_F16}:
            return False
        if kinds == {lcp.GGML_TYPE_F32}:
            return True
        import warnings

        warnings.warn(f"llamaspec.Llama keeps its KV cache in F16 (F32 with type_k=type_v=GGML_TYPE_F32); "
                      f"type_k={type_k}, type_v={type_v} ignored", CompatWarning, stacklevel=3)
        return False

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine and the model (``llama_cpp.Llama.close``)."""
        self._close_token_api()
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            engine.close()
        model, self._owned_model = getattr(self, "_owned_model", None), None
        if model is not None:
            model.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def engine(self):
        """The :class:`~llamaspec.engine.Engine` underneath (None with ``vocab_only``)."""
        return self._engine

    def _require_engine(self):
        if self._engine is None:
            why = "it was loaded with vocab_only=True" if self._owned_model is not None else "it is closed"
            raise CompatError(f"this Llama cannot generate: {why}")
        return self._engine

    # -- tokens -------------------------------------------------------------------------------------
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """``llama_cpp.Llama.tokenize``: UTF-8 bytes to tokens (``add_bos``: the vocabulary's BOS/EOS rules)."""
        return self._vocab.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: "Sequence[int]", prev_tokens: "Sequence[int] | None" = None,
                   special: bool = False) -> bytes:
        """``llama_cpp.Llama.detokenize``: the pieces' bytes (a leading space after BOS dropped)."""
        out = b"".join(self._vocab.token_to_piece(int(t), special=special) for t in tokens)
        if len(tokens) and int(tokens[0]) == self._vocab.bos and out[:1] == b" ":
            out = out[1:]
        return out

    def tokenizer(self):
        """``llama_cpp.Llama.tokenizer``: a new llama-cpp-python ``LlamaTokenizer`` of this model
        (:class:`LlamaTokenizer`)."""

        return LlamaTokenizer(self)

    def n_ctx(self) -> int:
        return self._n_ctx

    def n_vocab(self) -> int:
        return self._vocab.n_tokens

    def n_embd(self) -> int:
        return self._model.n_embd

    def token_bos(self) -> int:
        return self._vocab.bos

    def token_eos(self) -> int:
        return self._vocab.eos

    def token_nl(self) -> int:
        return self._special["nl"]

    # -- state ----------------------------------------------------------------------------------------
    def set_seed(self, seed: int) -> None:
        self._seed = seed

    def reset(self) -> None:
        """Forget the cached prompt: the next completion decodes its whole prompt again (``n_tokens`` = 0)."""
        self._cache_ok = False
        self.n_tokens = 0

    def _take_cache_permission(self) -> bool:
        ok, self._cache_ok = self._cache_ok, True
        return ok

    def save_state(self):
        """``llama_cpp.Llama.save_state``: the cached tokens and their state (:class:`~llamaspec.compat.state.
        LlamaState`, every slot's); :meth:`load_state` puts them back exactly."""
        from .state import save_state

        return save_state(self._require_engine(), self._seed, self._vocab.n_tokens)

    def load_state(self, state) -> None:
        """``llama_cpp.Llama.load_state``: back to a :meth:`save_state` state (the next completion whose prompt
        shares its prefix decodes only the rest)."""
        from .state import load_state

        self._seed = load_state(self._require_engine(), state)
        self._remember(state.input_ids[: state.n_tokens].tolist())  # n_tokens / input_ids as saved
        self._cache_ok = True

    def set_cache(self, cache) -> None:
        """``llama_cpp.Llama.set_cache``: a ``LlamaRAMCache`` / ``LlamaDiskCache`` (None: off) that completions
        read before and write after, with :meth:`load_state` / :meth:`save_state` (each slot also keeps its last
        prompt cached by itself)."""
        self.cache = cache

    @property
    def last_report(self) -> "dict | None":
        """llamaspec's report of the last finished completion (also in each response under ``"llamaspec"``)."""
        return self._last_report

    @property
    def last_tokens(self) -> "tuple[list[int], list[int]] | None":
        """``(prompt tokens, completion tokens)`` of the last finished completion."""
        return self._last_tokens

    def _report(self, stats) -> dict:
        e = self._engine
        d = stats.to_dict()
        d["speculative"] = bool(e is not None and e.speculative)
        d["drafters"] = list(e.chain.types) if e is not None and e.chain is not None else []
        return d

    # -- generation ---------------------------------------------------------------------------------
    def create_completion(self, prompt: "str | list[int]", suffix: "str | None" = None,
                          max_tokens: "int | None" = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, typical_p: float = 1.0, logprobs: "int | None" = None,
                          echo: bool = False, stop: "str | list[str] | None" = [],  # noqa: B006 - as llama_cpp
                          frequency_penalty: float = 0.0, presence_penalty: float = 0.0, repeat_penalty: float = 1.0,
                          top_k: int = 40, stream: bool = False, seed: "int | None" = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: "str | None" = None, stopping_criteria=None, logits_processor=None, grammar=None,
                          logit_bias: "dict | None" = None) -> "dict | Iterator[dict]":
        """``llama_cpp.Llama.create_completion``: the same arguments, defaults and return values (``tfs_z`` is
        accepted and unused, as in llama-cpp-python)."""
        check_request_args(suffix=suffix, mirostat_mode=mirostat_mode)
        self._require_engine()
        logprobs = check_logprobs(self, logprobs)
        sp = sampling_params(self, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                             repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty, grammar=grammar, logit_bias=logit_bias, seed=seed,
                             typical_p=typical_p, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
                             mirostat_eta=mirostat_eta)
        gen = completion_chunks(self, prompt, max_tokens=max_tokens, sampling=sp, stop=stop, stream=stream, echo=echo,
                                model=model, stopping_criteria=stopping_criteria, logprobs=logprobs, suffix=suffix,
                                logits_processor=logits_processor)
        return gen if stream else next(gen)

    def create_embedding(self, input: "str | list", model: "str | None" = None):  # noqa: A002 - llama_cpp's name
        """Refused: ``llamaspec.Llama`` builds its contexts for generation (use ``llama_cpp.Llama(...,
        embedding=True)``)."""
        raise CompatError("llamaspec.Llama does not compute embeddings; use llama_cpp.Llama(model_path, "
                          "embedding=True) for create_embedding/embed")

    def embed(self, input: "str | list", normalize: bool = False, truncate: bool = True,  # noqa: A002
              return_count: bool = False):
        """Refused, as :meth:`create_embedding`."""
        return self.create_embedding(input)

    def __call__(self, prompt: "str | list[int]", *args, **kwargs) -> "dict | Iterator[dict]":
        """``llm(prompt, ...)`` = :meth:`create_completion` (llama-cpp-python's positional order)."""
        return self.create_completion(prompt, *args, **kwargs)

    def create_chat_completion(self, messages: list, **kwargs) -> "dict | Iterator[dict]":
        """``llama_cpp.Llama.create_chat_completion``: the chat handler of ``chat_handler`` / ``chat_format``
        (default: the GGUF's template) renders ``messages`` and calls :meth:`create_completion`."""
        return self._chats.complete(messages, **kwargs)

    def create_chat_completion_openai_v1(self, *args, **kwargs):
        """:meth:`create_chat_completion` as ``openai`` objects (needs the ``openai`` package)."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError as e:
            raise ImportError("create_chat_completion_openai_v1 needs the openai package: pip install openai") from e
        if kwargs.get("stream", False):
            return (ChatCompletionChunk(**c) for c in self.create_chat_completion(*args, **kwargs))
        return ChatCompletion(**self.create_chat_completion(*args, **kwargs))

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: "str | None", additional_files: "list | None" = None,
                        local_dir=None, local_dir_use_symlinks: Any = "auto", cache_dir=None, **kwargs) -> "Llama":
        """``llama_cpp.Llama.from_pretrained``: the one file of ``repo_id`` matching the glob ``filename``,
        downloaded with ``huggingface_hub`` (``pip install huggingface-hub``; ``HF_ENDPOINT`` respected)."""
        from .hub import download

        path = download(repo_id, filename, additional_files=additional_files, local_dir=local_dir,
                        cache_dir=cache_dir)
        return cls(model_path=path, **kwargs)


class LlamaTokenizer(lcp.BaseLlamaTokenizer):
    """``Llama.tokenizer()`` / ``Llama.tokenizer_``: llama-cpp-python's ``BaseLlamaTokenizer`` reading the model's
    vocabulary (outlines' ``from_llamacpp`` reads it through this). The defaults are
    ``llama_cpp.llama_tokenizer.LlamaTokenizer``'s: ``tokenize`` parses special tokens, ``detokenize`` does not,
    ``encode`` / ``decode`` go through UTF-8 (invalid bytes dropped)."""

    def __init__(self, llama: "Llama"):
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> List[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: List[int], prev_tokens: Optional[List[int]] = None,
                   special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> List[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: List[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")

    @classmethod
    def from_ggml_file(cls, path: str) -> "LlamaTokenizer":
        return cls(Llama(model_path=path, vocab_only=True, verbose=False))
