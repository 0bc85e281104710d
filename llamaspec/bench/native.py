"""Driving the native llama.cpp tools built by ``scripts/build_llama_cpp.sh``.

* ``llama-server`` is started once per configuration on ``127.0.0.1`` with a free port (loopback only),
  one slot, ``--metrics``; each request is ``POST /completion`` with token ids, ``n_predict``, temperature
  0, ``cache_prompt: false`` and ``return_tokens: true``. Decode speed comes from the response's
  ``timings``; drafted / accepted / verification-step / per-position counts from the difference of the
  ``/metrics`` counters around the request (exact, unlike the rounded log line).
* ``llama-speculative-simple`` runs once per generation; it prints the generated text on stdout and its
  timings and the chain's statistics line on stderr.

Flags are llama.cpp's own (``common/arg.cpp``); :func:`common_args` and :func:`spec_args` build them from
the same settings the in-process engine uses.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..errors import LlamaSpecError
from ..params import SpecParams
from .modes import Mode

SERVER = "llama-server"
SPEC_SIMPLE = "llama-speculative-simple"
LOOPBACK = "127.0.0.1"


class NativeError(LlamaSpecError):
    pass


@dataclass
class RunSettings:
    """What every engine's runs share: context, threads, sampling seed, GPU placement, speculative settings."""
    n_ctx: int
    n_batch: int
    threads: int
    flash_attn: bool
    seed: int
    spec: SpecParams = field(default_factory=SpecParams)
    threads_batch: int = 0  # 0 = same as threads
    threads_draft: int = 0  # 0 = same as threads
    n_gpu_layers: int = 0  # -1 = all layers (the llamaspec runner gets models already loaded with it)
    n_gpu_layers_draft: int = 0
    main_gpu: int | None = None  # None = llama.cpp's default
    split_mode: str | None = None
    tensor_split: tuple[float, ...] | None = None
    #: the thread counts were given (-t / -tb / -td): llamaspec uses them as given; else it gets none and
    #: chooses each decode's count itself (llamaspec._llama.threads), as for a user who gives none
    threads_given: bool = True

    @property
    def placement(self) -> dict:
        """The multi-GPU placement, as :class:`~llamaspec._llama.Model` keyword arguments."""
        return dict(main_gpu=self.main_gpu, split_mode=self.split_mode, tensor_split=self.tensor_split)


def _ngl(n: int) -> str:
    """A layer count for the tools' ``-ngl``/``-ngld`` (their -1 means 'auto', fit to free memory: all layers
    is 'all')."""
    return "all" if n < 0 else str(n)


def find_tool(name: str, native_dir: str | os.PathLike | None = None) -> Path | None:
    """``bin/<name>`` (or ``<name>``) in ``native_dir`` alone when given; else in ``$LLAMASPEC_NATIVE_DIR``,
    ``./native`` and the ``native/`` folder of a source checkout of llamaspec."""
    env = os.environ.get("LLAMASPEC_NATIVE_DIR")
    dirs = [Path(native_dir)] if native_dir else ([Path(env)] if env else []) + [
        Path.cwd() / "native", Path(__file__).resolve().parents[2] / "native"]
    for d in dirs:
        for p in (d / "bin" / name, d / name):
            if p.is_file() and os.access(p, os.X_OK):
                return p
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def common_args(s: RunSettings) -> list[str]:
    """Context, threads, GPU offload and greedy sampling flags shared by both tools."""
    a = [
        "-c", str(s.n_ctx), "-b", str(s.n_batch), "-ub", str(s.n_batch),
        "-t", str(s.threads), "-tb", str(s.threads_batch or s.threads),
        "-fa", "on" if s.flash_attn else "off",
        "--temp", "0", "--top-k", "1", "--seed", str(s.seed),
        "-ngl", _ngl(s.n_gpu_layers),
    ]
    if s.main_gpu is not None:
        a += ["-mg", str(s.main_gpu)]
    if s.split_mode is not None:
        a += ["-sm", s.split_mode]
    if s.tensor_split is not None:
        a += ["-ts", ",".join(repr(float(x)) for x in s.tensor_split)]
    return a


def draft_device_args(s: RunSettings) -> list[str]:
    """The draft model's GPU layers and threads (``-ngld``, ``-td``; its batch threads follow ``-tb``)."""
    return ["-ngld", _ngl(s.n_gpu_layers_draft), "-td", str(s.threads_draft or s.threads)]


def spec_args(mode: Mode, spec: SpecParams, draft: str | None) -> list[str]:
    """Speculative flags for ``mode`` with ``spec``'s settings (§2.2 names).

    >>> from llamaspec.bench.modes import parse_mode
    >>> spec_args(parse_mode("plain"), SpecParams(), None)
    []
    >>> a = spec_args(parse_mode("ngram-mod"), SpecParams(), None)
    >>> a[:2], a[a.index("--spec-ngram-mod-n-match") + 1]
    (['--spec-type', 'ngram-mod'], '24')
    """
    if not mode.types:
        return []
    p = mode.spec_params(spec)
    a = ["--spec-type", ",".join(mode.types)]
    if mode.needs_draft:
        if not draft:
            raise NativeError(f"mode {mode.name} needs a draft model")
        a += ["-md", str(draft)]
    if mode.needs_draft or "draft-mtp" in mode.types:  # draft-mtp: the target's own MTP head, no -md
        a += ["--spec-draft-n-max", str(p.draft.n_max), "--spec-draft-n-min", str(p.draft.n_min),
              "--spec-draft-p-min", repr(float(p.draft.p_min))]
    if "ngram-mod" in mode.types:
        a += ["--spec-ngram-mod-n-match", str(p.ngram_mod.n_match), "--spec-ngram-mod-n-min", str(p.ngram_mod.n_min),
              "--spec-ngram-mod-n-max", str(p.ngram_mod.n_max)]
    for t in ("ngram-simple", "ngram-map-k", "ngram-map-k4v"):
        if t in mode.types:
            q = getattr(p, t.replace("-", "_"))
            k = t[len("ngram-"):]
            a += [f"--spec-ngram-{k}-size-n", str(q.size_n), f"--spec-ngram-{k}-size-m", str(q.size_m),
                  f"--spec-ngram-{k}-min-hits", str(q.min_hits)]
    if mode.synth_len is not None:
        a += ["--spec-synth-len", repr(float(mode.synth_len))]
    return a


# -------------------------------------------------------------------------------------------------
# llama-server
# -------------------------------------------------------------------------------------------------

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(url: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    if not url.startswith(f"http://{LOOPBACK}:"):  # pragma: no cover - guarded by construction
        raise NativeError(f"refusing a non-loopback address: {url}")
    data = None if body is None else json.dumps(body).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with _NO_PROXY.open(req, timeout=timeout) as r:
        return r.read()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name (with labels): value}, without the ``llamacpp:`` prefix.

    >>> parse_metrics('# HELP x\\nllamacpp:tokens_predicted_total 20\\nllamacpp:a{position="0"} 5\\n')
    {'tokens_predicted_total': 20.0, 'a{position="0"}': 5.0}
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("llamacpp:")] = float(value)
        except ValueError:
            continue
    return out


def per_pos_from_metrics(m: dict[str, float]) -> list[int]:
    pos: dict[int, int] = {}
    for k, v in m.items():
        mm = re.match(r'spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}', k)
        if mm:
            pos[int(mm.group(1))] = int(round(v))
    return [pos.get(i, 0) for i in range(max(pos) + 1)] if pos else []


class HttpServer:
    """A server process (``cmd(port)``: ``llamaspec serve`` or llama-server) on a free loopback port, ready once
    ``/health`` answers (``health_path``), answering greedy completions; its output goes to a log file in
    ``log_dir``."""

    health_path = "/health"

    def __init__(self, label: str, cmd: Callable[[int], list[str]], log_dir: str | None = None, env: dict | None = None):
        self.label, self._cmd, self.env = label, cmd, env
        self.port = 0
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix=f"llamaspec-bench-{label.replace('/', '_').replace(' ', '_')}-",
                                             suffix=".log", dir=log_dir)
        os.close(fd)

    @property
    def base(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return self._cmd(self.port)

    def start(self, timeout: float = 300.0) -> None:
        last_err = ""
        for _attempt in range(3):  # a port taken between free_port() and bind: try another one
            self.port = free_port()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, env=self.env)
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < timeout:
                    if self.proc.poll() is not None:
                        last_err = self.log_tail()
                        break
                    try:
                        _http(self.base + self.health_path, timeout=5)
                        return
                    except (urllib.error.URLError, OSError, ConnectionError):
                        time.sleep(0.2)
                else:
                    raise NativeError(f"{self.label} did not become ready in {timeout:.0f} s; log: {self.log_path}")
            except BaseException:  # not ready, Ctrl-C, SIGTERM: the process goes with the start that failed
                self.stop()
                raise
            if "bind" not in last_err and "address already in use" not in last_err.lower():
                break
        raise NativeError(f"{self.label} exited at start-up: {last_err.strip()[-600:]} (log: {self.log_path})")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:  # pragma: no cover
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.proc = None

    def remove_log(self) -> None:
        try:
            os.unlink(self.log_path)
        except OSError:  # pragma: no cover
            pass

    def complete(self, tokens: Sequence[int], n_predict: int, seed: int, conn: "KeepAlive | None" = None,
                 **extra) -> dict:
        """One greedy completion (``extra``: more body fields), on ``conn`` (a client's keep-alive connection) or
        a connection of its own."""
        body = {"prompt": list(tokens), "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": seed,
                "cache_prompt": False, "stream": False, **extra}
        if conn is not None:
            return conn.post_json("/completion", body, self.label)
        try:
            return json.loads(_http(self.base + "/completion", body).decode("utf-8"))
        except urllib.error.HTTPError as e:
            raise NativeError(f"{self.label}: HTTP {e.code}: {e.read()[:300]!r}") from None

    def connect(self) -> "KeepAlive":
        return KeepAlive(self.port)


class KeepAlive:
    """One client's persistent HTTP/1.1 connection to a loopback server; reconnects once when the server
    closed it between requests."""

    def __init__(self, port: int, timeout: float = 600.0):
        self.port, self.timeout = port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def post_json(self, path: str, body: dict, label: str) -> dict:
        data = json.dumps(body).encode("utf-8")
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, data, {"Content-Type": "application/json"})
                r = self.conn.getresponse()
                raw = r.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                if attempt:
                    raise
                continue
            if r.getheader("connection", "").lower() == "close":
                self.close()
            if r.status != 200:
                raise NativeError(f"{label}: HTTP {r.status}: {raw[:300]!r}")
            return json.loads(raw.decode("utf-8"))
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Server(HttpServer):
    """One ``llama-server`` process, one slot, with ``/metrics``."""

    def __init__(self, binary: Path, model: str, args: Sequence[str], *, log_dir: str | None = None, label: str = "server"):
        self.binary, self.model, self.args = binary, model, list(args)
        super().__init__(label, lambda port: [str(self.binary), "-m", str(self.model), "--host", LOOPBACK, "--port",
                                              str(port), "-np", "1", "--metrics", "--no-webui", "--cache-ram", "0",
                                              "-lv", "3", *self.args], log_dir)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(_http(self.base + "/metrics", timeout=60).decode("utf-8", "replace"))

    def complete_counted(self, tokens: Sequence[int], n_predict: int, seed: int) -> tuple[dict, dict[str, float]]:
        """One greedy completion; returns (response JSON with the tokens, metrics delta of this request)."""
        before = self.metrics()
        res = self.complete(tokens, n_predict, seed, return_tokens=True)
        after = self.metrics()
        want = before.get("tokens_predicted_total", 0) + res.get("tokens_predicted", 0)
        for _ in range(50):  # metrics are updated at slot release; normally already done
            if after.get("tokens_predicted_total", 0) >= want:
                break
            time.sleep(0.02)
            after = self.metrics()
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        return res, delta


# -------------------------------------------------------------------------------------------------
# llama-speculative-simple
# -------------------------------------------------------------------------------------------------

_RE_DEC = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_RE_ENC = re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_RE_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_RE_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_RE_STATS = re.compile(
    r"statistics\s+(\S+): #calls\(b,g,a\) =\s*(\d+)\s+(\d+)\s+(\d+), #gen drafts =\s*(\d+), #acc drafts =\s*(\d+), "
    r"#gen tokens =\s*(\d+), #acc tokens =\s*(\d+)(?:, #mean acc len = ([0-9.]+), #acc rate/pos = \(([^)]*)\))?"
)


@dataclass
class SpecSimpleResult:
    n_prompt: int
    n_predicted: int
    t_prompt_s: float
    t_decode_s: float
    n_drafted: int
    n_accepted: int
    n_verif_steps: int | None
    accepted_per_pos: list[int] | None
    text: str


def parse_spec_simple(stdout: str, stderr: str, prompt_text: str | None = None) -> SpecSimpleResult:
    """Numbers and generated text of one ``llama-speculative-simple`` run.

    The verification-step count and per-position counts come from the chain's statistics line
    (``#calls(b,g,a)``: ``a`` = accept calls = verification steps; rates have 3 decimals, so counts are
    recovered exactly while there are fewer than 2000 steps).

    >>> err = ("encoded    7 tokens in    0.001 seconds, speed: 1 t/s\\ndecoded   21 tokens in    0.039 seconds, speed: 5 t/s\\n"
    ...        "n_drafted = 39\\nn_accept  = 7\\nspec common_specu: statistics     draft-simple: #calls(b,g,a) =    1     14     14,"
    ...        " #gen drafts =     14, #acc drafts =     5, #gen tokens =     39, #acc tokens =     7, #mean acc len = 1.50,"
    ...        " #acc rate/pos = (0.357, 0.143, 0.000), dur(b,g,a) = 0.0, 1.0, 0.0 ms\\n")
    >>> r = parse_spec_simple("\\n\\nPROMPTabc\\n\\n\\n\\n", err, "PROMPT")
    >>> r.n_predicted, r.n_drafted, r.n_accepted, r.n_verif_steps, r.accepted_per_pos, r.text
    (21, 39, 7, 14, [5, 2, 0], 'abc')
    """
    m = _RE_DEC.search(stderr)
    e = _RE_ENC.search(stderr)
    if not m or not e:
        raise NativeError("llama-speculative-simple printed no timings: " + stderr.strip()[-400:])
    n_pred, t_dec = int(m.group(1)), float(m.group(2))
    md, ma = _RE_DRAFTED.search(stderr), _RE_ACCEPT.search(stderr)
    steps = per_pos = None
    drafted = int(md.group(1)) if md else 0
    accepted = int(ma.group(1)) if ma else 0
    st = _RE_STATS.search(stderr)
    if st:
        steps = int(st.group(4))
        drafted, accepted = int(st.group(7)), int(st.group(8))
        if st.group(10) is not None and st.group(10).strip():
            per_pos = [int(round(float(x) * steps)) for x in st.group(10).split(",")]
        elif steps == 0:
            per_pos = []
    text = stdout
    if text.startswith("\n\n"):
        text = text[2:]
    if prompt_text is not None and text.startswith(prompt_text):
        text = text[len(prompt_text):]
    while text.endswith("\n\n"):
        text = text[:-2]
    return SpecSimpleResult(int(e.group(1)), n_pred, float(e.group(2)), t_dec, drafted, accepted, steps, per_pos, text)


def run_spec_simple_parsed(binary: Path, model: str, args: Sequence[str], prompt: str, n_predict: int, prompt_prefix: str,
                           attempts: int = 3, timeout: float = 1800.0) -> tuple[list[str], SpecSimpleResult]:
    """Run one generation of ``n_predict`` tokens (the tool generates ``-n`` + 1, so ``-n`` is one less) and
    :func:`parse_spec_simple` it. The tool logs through an asynchronous logger that can lose its last lines
    when the process exits (seen under load: exit status 0, no timings); such a run is repeated (greedy
    generation is deterministic)."""
    cmd = [str(binary), "-m", str(model), "-p", prompt, "--no-escape", "-n", str(max(0, n_predict - 1)),
           "--color", "off", "-lv", "4", *args]
    last = ""
    for _ in range(attempts):
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        out = proc.stdout.decode("utf-8", "replace")
        err = proc.stderr.decode("utf-8", "replace")
        if proc.returncode != 0:
            raise NativeError(f"{SPEC_SIMPLE} exited with {proc.returncode}: {err.strip()[-500:]}")
        try:
            return cmd, parse_spec_simple(out, err, prompt_prefix)
        except NativeError as e:
            last = str(e)
    raise NativeError(f"{last} (after {attempts} attempts)")
