"""llama-server's command line as data: every flag of the pinned llama-server (the llama.cpp that
llama-cpp-python 0.3.36 vendors, ``llama-server --help``), with what ``llamaspec serve`` does with it.

One :class:`Flag` per llama-server option, in ``--help`` order: its spellings (``names``; ``neg`` the
``--no-X`` forms of an on/off option), ``kind`` (``V`` a switch, ``B`` an on/off pair, ``I`` / ``S`` one
integer / string value, ``S2`` two values), its ``LLAMA_ARG_*`` environment variable, and ``use``:

* ``"cli"``: an option of ``llamaspec serve`` itself (any llama-server spelling is rewritten to ours);
* ``"same"``: accepted silently, llamaspec already behaves that way (continuous batching, ...);
* ``"exit"``: prints something and exits (``--version``, ``--cache-list``, ...);
* ``"gone:HINT"``: removed from llama.cpp too: a usage error (exit 2) with llama.cpp's hint;
* anything else: why llamaspec ignores it, printed as one warning line when it is given.

``tests/test_serve_flags.py`` checks the table against ``native/bin/llama-server --help`` where the reference
is built (``scripts/build_llama_cpp.sh --targets tools``): the same 255 options, spellings and variables.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Flag", "FLAGS", "by_name"]


class Flag(NamedTuple):
    names: tuple[str, ...]
    kind: str
    env: str | None
    use: str
    neg: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The first long spelling (``--ctx-size``), or the only one."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    @property
    def nargs(self) -> int:
        return {"V": 0, "B": 0, "S2": 2}.get(self.kind, 1)


def _F(names: str, kind: str, env: str | None, use: str, neg: str = "") -> Flag:
    return Flag(tuple(names.split()), kind, env, use, tuple(neg.split()))


R_CPU = "thread placement, priority and polling are left to the OS"
R_KV = "llamaspec sizes the KV cache with -c"
R_REQ = "llamaspec takes it per request (the request field of the same name)"
R_CACHE = "llamaspec's prompt cache is --cache-prompt (the longest common prefix per slot)"
R_CLI = "it only affects llama-cli"
R_EMBD = "llamaspec serve has no embeddings or rerank routes"
R_MODEL = "llamaspec uses the GGUF's own RoPE and metadata settings"
R_PLACE = "llamaspec places the model with -ngl, -sm, -ts and -mg only"
R_MTMD = "llamaspec serve is text-only (no multimodal projector)"
R_LOAD = "llamaspec loads models with memory-mapping, as llama.cpp's default"
R_FIT = "llamaspec does not fit the model to free memory: set -c and -ngl"
R_LORA = "LoRA adapters and control vectors are not supported by llamaspec"
R_DOCKER = "llamaspec cannot pull from Docker Hub: give -m PATH or -hf REPO"
R_UI = "llamaspec serve has no web UI"
R_TOOLS = "llamaspec serve runs no server-side tools or MCP servers"
R_KWARGS = "llamaspec's chat templates take no extra arguments yet"
R_ROUTER = "llamaspec serve runs one model (no router mode)"
R_REASON = "llamaspec returns the text as generated (no reasoning parsing)"
R_SLEEP = "llamaspec keeps the model loaded"
R_LOGFMT = "llamaspec logs as text on stderr (and --log-file)"
R_KVTYPE = "the draft's KV cache is F16 in llamaspec"
R_PSPLIT = "llamaspec drafts a single sequence, not a tree"
R_PRESET = "it selects a model hosted on Hugging Face: give -m PATH or -hf REPO"

FLAGS: tuple[Flag, ...] = (
    _F('-h --help --usage', 'V', None, 'exit'),
    _F('--version', 'V', None, 'exit'),
    _F('-cl --cache-list', 'V', None, 'exit'),
    _F('--completion-bash', 'V', None, 'exit'),
    _F('-t --threads', 'I', 'LLAMA_ARG_THREADS', 'cli'),
    _F('-tb --threads-batch', 'I', None, 'cli'),
    _F('-C --cpu-mask', 'S', None, R_CPU),
    _F('-Cr --cpu-range', 'S', None, R_CPU),
    _F('--cpu-strict', 'S', None, R_CPU),
    _F('--prio', 'I', None, R_CPU),
    _F('--poll', 'S', None, R_CPU),
    _F('-Cb --cpu-mask-batch', 'S', None, R_CPU),
    _F('-Crb --cpu-range-batch', 'S', None, R_CPU),
    _F('--cpu-strict-batch', 'I', None, R_CPU),
    _F('--prio-batch', 'I', None, R_CPU),
    _F('--poll-batch', 'I', None, R_CPU),
    _F('-lcs --lookup-cache-static', 'S', None, 'cli'),
    _F('-lcd --lookup-cache-dynamic', 'S', None, 'cli'),
    _F('-c --ctx-size', 'I', 'LLAMA_ARG_CTX_SIZE', 'cli'),
    _F('--kv-unified-per-slot', 'I', 'LLAMA_ARG_KV_UNIFIED_PER_SLOT', R_KV),
    _F('-n --predict --n-predict', 'I', 'LLAMA_ARG_N_PREDICT', 'cli'),
    _F('-b --batch-size', 'I', 'LLAMA_ARG_BATCH', 'cli'),
    _F('-ub --ubatch-size', 'I', 'LLAMA_ARG_UBATCH', 'cli'),
    _F('--keep', 'I', None, R_REQ),
    _F('--swa-full', 'V', 'LLAMA_ARG_SWA_FULL', R_CACHE),
    _F('-ctxcp --ctx-checkpoints --swa-checkpoints', 'I', 'LLAMA_ARG_CTX_CHECKPOINTS', R_CACHE),
    _F('-cms --checkpoint-min-step', 'I', 'LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT', R_CACHE),
    _F('-cram --cache-ram', 'I', 'LLAMA_ARG_CACHE_RAM', R_CACHE),
    _F('-kvu --kv-unified', 'B', 'LLAMA_ARG_KV_UNIFIED', 'cli', neg='-no-kvu --no-kv-unified'),
    _F('--cache-idle-slots', 'B', 'LLAMA_ARG_CACHE_IDLE_SLOTS', R_CACHE, neg='--no-cache-idle-slots'),
    _F('--context-shift', 'B', 'LLAMA_ARG_CONTEXT_SHIFT', 'cli', neg='--no-context-shift'),
    _F('-fa --flash-attn', 'S', 'LLAMA_ARG_FLASH_ATTN', 'cli'),
    _F('--perf', 'B', 'LLAMA_ARG_PERF', 'same', neg='--no-perf'),
    _F('-e --escape', 'B', None, 'same', neg='--no-escape'),
    _F('-r --reverse-prompt', 'S', None, R_CLI),
    _F('-sp --special', 'V', None, R_CLI),
    _F('--warmup', 'B', None, 'same', neg='--no-warmup'),
    _F('--spm-infill', 'V', None, 'cli'),
    _F('--samplers', 'S', None, 'cli'),
    _F('-s --seed', 'S', None, 'cli'),
    _F('--sampler-seq --sampling-seq', 'S', None, 'cli'),
    _F('--ignore-eos', 'V', None, R_REQ),
    _F('--temp --temperature', 'S', 'LLAMA_ARG_TEMPERATURE', 'cli'),
    _F('--top-k', 'I', 'LLAMA_ARG_TOP_K', 'cli'),
    _F('--top-p', 'S', 'LLAMA_ARG_TOP_P', 'cli'),
    _F('--min-p', 'S', 'LLAMA_ARG_MIN_P', 'cli'),
    _F('--top-nsigma --top-n-sigma', 'S', None, 'cli'),
    _F('--xtc-probability', 'S', None, 'cli'),
    _F('--xtc-threshold', 'S', None, 'cli'),
    _F('--typical --typical-p', 'S', None, 'cli'),
    _F('--repeat-last-n', 'I', None, 'cli'),
    _F('--repeat-penalty', 'S', 'LLAMA_ARG_REPEAT_PENALTY', 'cli'),
    _F('--presence-penalty', 'S', 'LLAMA_ARG_PRESENCE_PENALTY', 'cli'),
    _F('--frequency-penalty', 'S', 'LLAMA_ARG_FREQUENCY_PENALTY', 'cli'),
    _F('--dry-multiplier', 'S', None, 'cli'),
    _F('--dry-base', 'S', None, 'cli'),
    _F('--dry-allowed-length', 'I', None, 'cli'),
    _F('--dry-penalty-last-n', 'I', None, 'cli'),
    _F('--dry-sequence-breaker', 'S', None, 'cli'),
    _F('--adaptive-target', 'S', None, 'cli'),
    _F('--adaptive-decay', 'S', None, 'cli'),
    _F('--dynatemp-range', 'S', None, 'cli'),
    _F('--dynatemp-exp', 'S', None, 'cli'),
    _F('--mirostat', 'I', None, 'cli'),
    _F('--mirostat-lr', 'S', None, 'cli'),
    _F('--mirostat-ent', 'S', None, 'cli'),
    _F('-l --logit-bias', 'S', None, R_REQ),
    _F('--grammar', 'S', None, R_REQ),
    _F('--grammar-file', 'S', None, R_REQ),
    _F('-j --json-schema', 'S', None, R_REQ),
    _F('-jf --json-schema-file', 'S', None, R_REQ),
    _F('-bs --backend-sampling', 'V', 'LLAMA_ARG_BACKEND_SAMPLING', 'same'),
    _F('--pooling', 'S', 'LLAMA_ARG_POOLING', R_EMBD),
    _F('--rope-scaling', 'S', 'LLAMA_ARG_ROPE_SCALING_TYPE', R_MODEL),
    _F('--rope-scale', 'S', 'LLAMA_ARG_ROPE_SCALE', R_MODEL),
    _F('--rope-freq-base', 'S', 'LLAMA_ARG_ROPE_FREQ_BASE', R_MODEL),
    _F('--rope-freq-scale', 'S', 'LLAMA_ARG_ROPE_FREQ_SCALE', R_MODEL),
    _F('--yarn-orig-ctx', 'I', 'LLAMA_ARG_YARN_ORIG_CTX', R_MODEL),
    _F('--yarn-ext-factor', 'S', 'LLAMA_ARG_YARN_EXT_FACTOR', R_MODEL),
    _F('--yarn-attn-factor', 'S', 'LLAMA_ARG_YARN_ATTN_FACTOR', R_MODEL),
    _F('--yarn-beta-slow', 'S', 'LLAMA_ARG_YARN_BETA_SLOW', R_MODEL),
    _F('--yarn-beta-fast', 'S', 'LLAMA_ARG_YARN_BETA_FAST', R_MODEL),
    _F('-kvo --kv-offload', 'B', 'LLAMA_ARG_KV_OFFLOAD', R_PLACE, neg='-nkvo --no-kv-offload'),
    _F('--repack', 'B', 'LLAMA_ARG_REPACK', R_PLACE, neg='-nr --no-repack'),
    _F('--no-host', 'V', 'LLAMA_ARG_NO_HOST', R_PLACE),
    _F('-ctk --cache-type-k', 'S', 'LLAMA_ARG_CACHE_TYPE_K', 'cli'),
    _F('-ctv --cache-type-v', 'S', 'LLAMA_ARG_CACHE_TYPE_V', 'cli'),
    _F('-dt --defrag-thold', 'S', 'LLAMA_ARG_DEFRAG_THOLD', 'same'),
    _F('-np --parallel', 'I', 'LLAMA_ARG_N_PARALLEL', 'cli'),
    _F('-cb --cont-batching', 'B', 'LLAMA_ARG_CONT_BATCHING', 'same', neg='-nocb --no-cont-batching'),
    _F('-mm --mmproj', 'S', 'LLAMA_ARG_MMPROJ', R_MTMD),
    _F('-mmu --mmproj-url', 'S', 'LLAMA_ARG_MMPROJ_URL', R_MTMD),
    _F('--mmproj-auto', 'B', 'LLAMA_ARG_MMPROJ_AUTO', R_MTMD, neg='--no-mmproj --no-mmproj-auto'),
    _F('--mmproj-offload', 'B', 'LLAMA_ARG_MMPROJ_OFFLOAD', R_MTMD, neg='--no-mmproj-offload'),
    _F('-mmdev --mmproj-device', 'S', 'MTMD_BACKEND_DEVICE', R_MTMD),
    _F('--image-min-tokens', 'I', 'LLAMA_ARG_IMAGE_MIN_TOKENS', R_MTMD),
    _F('--image-max-tokens', 'I', 'LLAMA_ARG_IMAGE_MAX_TOKENS', R_MTMD),
    _F('--mtmd-batch-max-tokens', 'I', 'LLAMA_ARG_MTMD_BATCH_MAX_TOKENS', R_MTMD),
    _F('--video-fps', 'S', 'LLAMA_ARG_VIDEO_FPS', R_MTMD),
    _F('--video-timestamp-interval', 'I', 'LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL', R_MTMD),
    _F('--video-ffmpeg-dir', 'S', 'LLAMA_ARG_VIDEO_FFMPEG_DIR', R_MTMD),
    _F('--rpc', 'S', 'LLAMA_ARG_RPC', 'cli'),
    _F('-lm --load-mode', 'S', 'LLAMA_ARG_LOAD_MODE', R_LOAD),
    _F('-lzm --lazy-mode', 'S', 'LLAMA_ARG_LAZY_MODE', R_LOAD),
    _F('--numa', 'S', 'LLAMA_ARG_NUMA', R_CPU),
    _F('-dev --device', 'S', 'LLAMA_ARG_DEVICE', R_PLACE),
    _F('--list-devices', 'V', None, 'exit'),
    _F('-ot --override-tensor', 'S', 'LLAMA_ARG_OVERRIDE_TENSOR', R_PLACE),
    _F('-cmoe --cpu-moe', 'V', 'LLAMA_ARG_CPU_MOE', R_PLACE),
    _F('-ncmoe --n-cpu-moe', 'I', 'LLAMA_ARG_N_CPU_MOE', R_PLACE),
    _F('-ncffn --n-cpu-ffn', 'I', 'LLAMA_ARG_N_CPU_FFN', R_PLACE),
    _F('-ngl --gpu-layers --n-gpu-layers', 'S', 'LLAMA_ARG_N_GPU_LAYERS', 'cli'),
    _F('-sm --split-mode', 'S', 'LLAMA_ARG_SPLIT_MODE', 'cli'),
    _F('-ts --tensor-split', 'S', 'LLAMA_ARG_TENSOR_SPLIT', 'cli'),
    _F('-mg --main-gpu', 'I', 'LLAMA_ARG_MAIN_GPU', 'cli'),
    _F('-fit --fit', 'S', 'LLAMA_ARG_FIT', R_FIT),
    _F('-fitt --fit-target', 'S', 'LLAMA_ARG_FIT_TARGET', R_FIT),
    _F('-fitc --fit-ctx', 'I', 'LLAMA_ARG_FIT_CTX', R_FIT),
    _F('--check-tensors', 'V', None, R_LOAD),
    _F('--override-kv', 'S', None, R_MODEL),
    _F('--op-offload', 'B', None, R_PLACE, neg='--no-op-offload'),
    _F('--lora', 'S', None, R_LORA),
    _F('--lora-scaled', 'S', None, R_LORA),
    _F('--control-vector', 'S', None, R_LORA),
    _F('--control-vector-scaled', 'S', None, R_LORA),
    _F('--control-vector-layer-range', 'S2', None, R_LORA),
    _F('-a --alias', 'S', 'LLAMA_ARG_ALIAS', 'cli'),
    _F('--tags', 'S', 'LLAMA_ARG_TAGS', 'cli'),
    _F('-m --model', 'S', 'LLAMA_ARG_MODEL', 'cli'),
    _F('-mu --model-url', 'S', 'LLAMA_ARG_MODEL_URL', 'cli'),
    _F('-dr --docker-repo', 'S', 'LLAMA_ARG_DOCKER_REPO', R_DOCKER),
    _F('-hf -hfr --hf-repo', 'S', 'LLAMA_ARG_HF_REPO', 'cli'),
    _F('-hff --hf-file', 'S', 'LLAMA_ARG_HF_FILE', 'cli'),
    _F('-hft --hf-token', 'S', 'HF_TOKEN', 'cli'),
    _F('--embd-normalize', 'I', None, R_EMBD),
    _F('--host', 'S', 'LLAMA_ARG_HOST', 'cli'),
    _F('--port', 'I', 'LLAMA_ARG_PORT', 'cli'),
    _F('--reuse-port', 'V', 'LLAMA_ARG_REUSE_PORT', 'cli'),
    _F('--path', 'S', 'LLAMA_ARG_STATIC_PATH', R_UI),
    _F('--cors-origins', 'S', 'LLAMA_ARG_CORS_ORIGINS', 'cli'),
    _F('--cors-methods', 'S', 'LLAMA_ARG_CORS_METHODS', 'cli'),
    _F('--cors-headers', 'S', 'LLAMA_ARG_CORS_HEADERS', 'cli'),
    _F('--cors-credentials', 'B', 'LLAMA_ARG_CORS_CREDENTIALS', 'cli', neg='--no-cors-credentials'),
    _F('--api-prefix', 'S', 'LLAMA_ARG_API_PREFIX', 'cli'),
    _F('--ui-config --webui-config', 'S', 'LLAMA_ARG_UI_CONFIG', R_UI),
    _F('--ui-config-file --webui-config-file', 'S', 'LLAMA_ARG_UI_CONFIG_FILE', R_UI),
    _F('--ui-mcp-proxy --webui-mcp-proxy', 'B', 'LLAMA_ARG_UI_MCP_PROXY', 'cli', neg='--no-ui-mcp-proxy --no-webui-mcp-proxy'),
    _F('--tools', 'S', 'LLAMA_ARG_TOOLS', 'cli'),
    _F('--tools-runtime', 'S', 'LLAMA_ARG_TOOLS_RUNTIME', R_TOOLS),
    _F('--mcp-servers-config', 'S', 'LLAMA_ARG_MCP_SERVERS_CONFIG', 'cli'),
    _F('--mcp-servers-json', 'S', 'LLAMA_ARG_MCP_SERVERS_JSON', 'cli'),
    _F('-ag --agent', 'B', 'LLAMA_ARG_AGENT', R_TOOLS, neg='-no-ag --no-agent'),
    _F('--ui --webui', 'B', 'LLAMA_ARG_UI', R_UI, neg='--no-ui --no-webui'),
    _F('--embedding --embeddings', 'V', 'LLAMA_ARG_EMBEDDINGS', R_EMBD),
    _F('--rerank --reranking', 'V', 'LLAMA_ARG_RERANKING', R_EMBD),
    _F('--api-key', 'S', 'LLAMA_API_KEY', 'cli'),
    _F('--api-key-file', 'S', 'LLAMA_ARG_API_KEY_FILE', 'cli'),
    _F('--ssl-key-file', 'S', 'LLAMA_ARG_SSL_KEY_FILE', 'cli'),
    _F('--ssl-cert-file', 'S', 'LLAMA_ARG_SSL_CERT_FILE', 'cli'),
    _F('--chat-template-kwargs', 'S', 'LLAMA_ARG_CHAT_TEMPLATE_KWARGS', R_KWARGS),
    _F('-to --timeout', 'I', 'LLAMA_ARG_TIMEOUT', 'cli'),
    _F('--sse-ping-interval', 'I', 'LLAMA_ARG_SSE_PING_INTERVAL', 'cli'),
    _F('--threads-http', 'I', 'LLAMA_ARG_THREADS_HTTP', 'same'),
    _F('--cache-prompt', 'B', 'LLAMA_ARG_CACHE_PROMPT', 'cli', neg='--no-cache-prompt'),
    _F('--cache-reuse', 'I', 'LLAMA_ARG_CACHE_REUSE', R_CACHE),
    _F('--metrics', 'V', 'LLAMA_ARG_ENDPOINT_METRICS', 'cli'),
    _F('--props', 'V', 'LLAMA_ARG_ENDPOINT_PROPS', 'cli'),
    _F('--slots', 'B', 'LLAMA_ARG_ENDPOINT_SLOTS', 'cli', neg='--no-slots'),
    _F('--slot-save-path', 'S', None, 'cli'),
    _F('--media-path', 'S', None, R_MTMD),
    _F('--models-dir', 'S', 'LLAMA_ARG_MODELS_DIR', R_ROUTER),
    _F('--models-preset', 'S', 'LLAMA_ARG_MODELS_PRESET', R_ROUTER),
    _F('--models-max', 'I', 'LLAMA_ARG_MODELS_MAX', R_ROUTER),
    _F('--models-autoload', 'B', 'LLAMA_ARG_MODELS_AUTOLOAD', R_ROUTER, neg='--no-models-autoload'),
    _F('--jinja', 'B', 'LLAMA_ARG_JINJA', 'cli', neg='--no-jinja'),
    _F('--reasoning-format', 'S', 'LLAMA_ARG_THINK', R_REASON),
    _F('-rea --reasoning', 'S', 'LLAMA_ARG_REASONING', R_REASON),
    _F('--reasoning-effort', 'S', 'LLAMA_ARG_REASONING_EFFORT', R_REASON),
    _F('--reasoning-budget', 'I', 'LLAMA_ARG_THINK_BUDGET', R_REASON),
    _F('--reasoning-budget-message', 'S', 'LLAMA_ARG_THINK_BUDGET_MESSAGE', R_REASON),
    _F('--reasoning-preserve', 'B', 'LLAMA_ARG_REASONING_PRESERVE', R_REASON, neg='--no-reasoning-preserve'),
    _F('--chat-template', 'S', 'LLAMA_ARG_CHAT_TEMPLATE', 'cli'),
    _F('--chat-template-file', 'S', 'LLAMA_ARG_CHAT_TEMPLATE_FILE', 'cli'),
    _F('--skip-chat-parsing', 'B', 'LLAMA_ARG_SKIP_CHAT_PARSING', R_REASON, neg='--no-skip-chat-parsing'),
    _F('--prefill-assistant', 'B', 'LLAMA_ARG_PREFILL_ASSISTANT', 'same', neg='--no-prefill-assistant'),
    _F('-sps --slot-prompt-similarity', 'S', None, 'cli'),
    _F('--lora-init-without-apply', 'V', None, R_LORA),
    _F('--sleep-idle-seconds', 'I', None, R_SLEEP),
    _F('--log-disable', 'V', None, 'cli'),
    _F('--log-file', 'S', 'LLAMA_ARG_LOG_FILE', 'cli'),
    _F('--log-jsonl', 'B', 'LLAMA_ARG_LOG_JSONL', R_LOGFMT, neg='--no-log-jsonl'),
    _F('--log-prompts-dir', 'S', None, R_LOGFMT),
    _F('--log-colors', 'S', 'LLAMA_ARG_LOG_COLORS', 'same'),
    _F('-v --verbose --log-verbose', 'V', None, 'cli'),
    _F('--offline', 'V', 'LLAMA_ARG_OFFLINE', 'cli'),
    _F('-lv --verbosity --log-verbosity', 'I', 'LLAMA_ARG_LOG_VERBOSITY', 'cli'),
    _F('--log-prefix', 'B', 'LLAMA_ARG_LOG_PREFIX', 'same', neg='--no-log-prefix'),
    _F('--log-timestamps', 'B', 'LLAMA_ARG_LOG_TIMESTAMPS', 'same', neg='--no-log-timestamps'),
    _F('--spec-draft-hf -hfd -hfrd --hf-repo-draft', 'S', 'LLAMA_ARG_SPEC_DRAFT_HF_REPO', 'cli'),
    _F('--spec-draft-threads -td --threads-draft', 'I', None, 'cli'),
    _F('--spec-draft-threads-batch -tbd --threads-batch-draft', 'I', None, R_CPU),
    _F('--spec-draft-cpu-mask -Cd --cpu-mask-draft', 'S', None, R_CPU),
    _F('--spec-draft-cpu-range -Crd --cpu-range-draft', 'S', None, R_CPU),
    _F('--spec-draft-cpu-strict --cpu-strict-draft', 'I', None, R_CPU),
    _F('--spec-draft-prio --prio-draft', 'I', None, R_CPU),
    _F('--spec-draft-poll --poll-draft', 'I', None, R_CPU),
    _F('--spec-draft-cpu-mask-batch -Cbd --cpu-mask-batch-draft', 'S', None, R_CPU),
    _F('--spec-draft-cpu-strict-batch --cpu-strict-batch-draft', 'I', None, R_CPU),
    _F('--spec-draft-prio-batch --prio-batch-draft', 'I', None, R_CPU),
    _F('--spec-draft-poll-batch --poll-batch-draft', 'I', None, R_CPU),
    _F('--spec-draft-type-k -ctkd --cache-type-k-draft', 'S', 'LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K', R_KVTYPE),
    _F('--spec-draft-type-v -ctvd --cache-type-v-draft', 'S', 'LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V', R_KVTYPE),
    _F('--spec-draft-override-tensor -otd --override-tensor-draft', 'S', None, R_PLACE),
    _F('--spec-draft-cpu-moe -cmoed --cpu-moe-draft', 'V', 'LLAMA_ARG_SPEC_DRAFT_CPU_MOE', R_PLACE),
    _F('--spec-draft-n-cpu-moe --spec-draft-ncmoe -ncmoed --n-cpu-moe-draft', 'I', 'LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE', R_PLACE),
    _F('--spec-draft-n-max', 'I', 'LLAMA_ARG_SPEC_DRAFT_N_MAX', 'cli'),
    _F('--spec-draft-n-min', 'I', 'LLAMA_ARG_SPEC_DRAFT_N_MIN', 'cli'),
    _F('--spec-synth-len', 'S', 'LLAMA_ARG_SPEC_SYNTH_LEN', 'cli'),
    _F('--spec-synth-rates', 'S', 'LLAMA_ARG_SPEC_SYNTH_RATES', 'cli'),
    _F('--spec-draft-p-split --draft-p-split', 'S', 'LLAMA_ARG_SPEC_DRAFT_P_SPLIT', R_PSPLIT),
    _F('--spec-draft-p-min --draft-p-min', 'S', 'LLAMA_ARG_SPEC_DRAFT_P_MIN', 'cli'),
    _F('--spec-draft-backend-sampling', 'B', 'LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING', 'same', neg='--no-spec-draft-backend-sampling'),
    _F('--spec-draft-device -devd --device-draft', 'S', None, R_PLACE),
    _F('--spec-draft-ngl -ngld --gpu-layers-draft --n-gpu-layers-draft', 'S', 'LLAMA_ARG_N_GPU_LAYERS_DRAFT', 'cli'),
    _F('--spec-draft-model -md --model-draft', 'S', 'LLAMA_ARG_SPEC_DRAFT_MODEL', 'cli'),
    _F('--spec-type', 'S', 'LLAMA_ARG_SPEC_TYPE', 'cli'),
    _F('--spec-ngram-mod-n-min', 'I', None, 'cli'),
    _F('--spec-ngram-mod-n-max', 'I', None, 'cli'),
    _F('--spec-ngram-mod-n-match', 'I', None, 'cli'),
    _F('--spec-ngram-simple-size-n', 'I', None, 'cli'),
    _F('--spec-ngram-simple-size-m', 'I', None, 'cli'),
    _F('--spec-ngram-simple-min-hits', 'I', None, 'cli'),
    _F('--spec-ngram-map-k-size-n', 'I', None, 'cli'),
    _F('--spec-ngram-map-k-size-m', 'I', None, 'cli'),
    _F('--spec-ngram-map-k-min-hits', 'I', None, 'cli'),
    _F('--spec-ngram-map-k4v-size-n', 'I', None, 'cli'),
    _F('--spec-ngram-map-k4v-size-m', 'I', None, 'cli'),
    _F('--spec-ngram-map-k4v-min-hits', 'I', None, 'cli'),
    _F('--draft --draft-n --draft-max', 'I', 'LLAMA_ARG_DRAFT_MAX', 'gone:use --spec-draft-n-max or --spec-ngram-mod-n-max'),
    _F('--draft-min --draft-n-min', 'I', 'LLAMA_ARG_DRAFT_MIN', 'gone:use --spec-draft-n-min or --spec-ngram-mod-n-min'),
    _F('--spec-ngram-size-n', 'I', None, 'gone:use the respective --spec-ngram-*-size-n or --spec-ngram-mod-n-match'),
    _F('--spec-ngram-size-m', 'I', None, 'gone:use the respective --spec-ngram-*-size-m'),
    _F('--spec-ngram-min-hits', 'I', None, 'gone:use the respective --spec-ngram-*-min-hits'),
    _F('--embd-gemma-default', 'V', None, R_PRESET),
    _F('--fim-qwen-1.5b-default', 'V', None, R_PRESET),
    _F('--fim-qwen-3b-default', 'V', None, R_PRESET),
    _F('--fim-qwen-7b-default', 'V', None, R_PRESET),
    _F('--fim-qwen-7b-spec', 'V', None, R_PRESET),
    _F('--fim-qwen-14b-spec', 'V', None, R_PRESET),
    _F('--fim-qwen-30b-default', 'V', None, R_PRESET),
    _F('--gpt-oss-20b-default', 'V', None, R_PRESET),
    _F('--gpt-oss-120b-default', 'V', None, R_PRESET),
    _F('--vision-gemma-4b-default', 'V', None, R_PRESET),
    _F('--vision-gemma-12b-default', 'V', None, R_PRESET),
    _F('--spec-default', 'V', None, 'cli'),
)

_BY_NAME = {n: f for f in FLAGS for n in f.names + f.neg}


def by_name(name: str) -> Flag | None:
    """The flag spelled ``name`` (``--x_y`` counts as ``--x-y``, as llama-server reads it), or None."""
    if name.startswith("--"):
        name = name.replace("_", "-")
    return _BY_NAME.get(name)
