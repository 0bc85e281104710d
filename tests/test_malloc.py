"""llamaspec.malloc: the heap trims that keep the server's RSS flat under load (issue 21), and a sampler chain
that leaked when it was refused.

The trimmer's schedule with a fake clock; ``malloc_trim`` for real in a subprocess (harmless, and it gives back
what a thread freed); a no-op where the C library is not glibc; the server's dispatcher trimming after
requests, whose answers stay the same."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llamaspec import malloc

ROOT = Path(__file__).resolve().parents[1]
glibc = pytest.mark.skipif(not malloc.is_glibc(), reason="glibc only")


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trimmer_trims_when_asked_at_most_once_per_interval():
    calls, clock = [], _Clock()
    t = malloc.Trimmer(2.0, trim_fn=lambda: calls.append(clock.t), clock=clock)
    assert not t.poll() and calls == []  # nothing asked for
    t.request()
    assert t.pending and t.poll() and calls == [100.0] and not t.pending
    assert not t.poll()  # asked once, trimmed once
    clock.t = 101.0
    t.request()
    assert not t.poll() and t.pending  # too early: kept for a later poll
    clock.t = 102.0
    assert t.poll() and calls == [100.0, 102.0]
    assert t.n_trims == 2 and t.max_seconds >= 0 and t.seconds >= t.max_seconds


def test_trimmer_survives_a_failing_trim():
    def boom():
        raise OSError("no")

    t = malloc.Trimmer(0.0, trim_fn=boom)
    t.request()
    assert t.poll() and t.n_trims == 1
    t.request()
    assert t.poll() and t.n_trims == 2


def test_no_op_without_glibc(monkeypatch):
    monkeypatch.setattr(malloc, "_malloc_trim", lambda: None)
    assert not malloc.is_glibc() and not malloc.trim()
    t = malloc.Trimmer(0.0)
    t.request()
    assert t.poll() and t.n_trims == 1  # the schedule runs; the trim does nothing


@glibc
def test_a_trim_is_harmless_and_gives_back_what_a_thread_freed():
    # a thread fills its arena with 40 MB of small blocks and frees all but the last (so glibc cannot shrink
    # the arena from its top): the pages stay resident until malloc_trim(0); a subprocess, for a clean heap
    code = """
        import ctypes, threading
        from llamaspec import malloc
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        def rss():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) / 1024
        def work():
            blocks = [libc.malloc(16384) for _ in range(2560)]
            for b in blocks:
                ctypes.memset(b, 1, 16384)
            for b in blocks[:-1]:
                libc.free(b)
        t = threading.Thread(target=work); t.start(); t.join()
        before = rss()
        print(malloc.trim())
        print(before - rss())
        x = [bytearray(1 << 20) for _ in range(8)]  # allocating afterwards works
        print(sum(map(len, x)))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    trimmed, freed, n = out.stdout.split()
    assert trimmed == "True" and float(freed) > 30 and int(n) == 8 << 20


def test_the_server_trims_after_requests_and_answers_the_same(tiny_model):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.engine import Engine
    from llamaspec.server.app import ServerConfig, ServerState, create_app

    eng = Engine(tiny_model("llama"), n_ctx=256, n_parallel=2, flash_attn=False, kv_f32=True)
    state = ServerState(ServerConfig(chat_template="chatml"), engine=eng)
    state.trimmer.interval = 0.0
    bodies = [{"prompt": "hello there", "n_predict": 8, "temperature": 0},
              {"prompt": "hello there", "n_predict": 8, "temperature": 0, "json_schema": {"type": "object"}}]
    with TestClient(create_app(state)) as c:
        first = [c.post("/completion", json=b).json()["content"] for b in bodies]
        deadline = time.monotonic() + 10
        while state.trimmer.n_trims == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state.trimmer.n_trims >= 1
        assert [c.post("/completion", json=b).json()["content"] for b in bodies] == first


def test_a_refused_sampler_chain_leaves_nothing_native(tiny_model, monkeypatch):
    # a logit bias outside the vocabulary (a 400 of the server) left its llama_sampler_chain behind: 112 bytes
    # a request, never freed
    from llamaspec import _llama as llama
    from llamaspec._llama import sampler as mod
    from llamaspec.errors import LlamaSpecError

    made, freed = [], []
    init, free = mod.native.llama_sampler_chain_init, mod.native.llama_sampler_free
    monkeypatch.setattr(mod.native, "llama_sampler_chain_init", lambda p: made.append(init(p)) or made[-1])
    monkeypatch.setattr(mod.native, "llama_sampler_free", lambda s: freed.append(s) or free(s))
    with llama.Model(tiny_model("llama")) as model:
        for params in (llama.SamplingParams(temp=0.8, logit_bias=((10 ** 9, 1.0),)),
                       llama.SamplingParams(grammar="root ::= undefined")):
            with pytest.raises(LlamaSpecError):
                llama.Sampler.from_params(model.vocab, params)
        assert len(made) == len(freed) == 1  # the grammar's chain, made and freed; the bias's never made
        llama.Sampler.from_params(model.vocab, llama.SamplingParams(temp=0.8)).close()
        assert len(made) == len(freed) == 2
