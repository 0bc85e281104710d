"""Slot save / restore / erase: ``POST /slots/{id}?action=...`` with ``--slot-save-path`` on a real
``llamaspec serve`` process (draft-simple with the tiny draft: the draft context must catch up after a
restore), the engine side (:mod:`llamaspec.slot_state`) on PART, SWA and FULL memories, llama-server's file
format (the packed and the legacy token list), and ``llamaspec.Llama.save_state`` / ``load_state``."""
from __future__ import annotations

import pickle
import struct

import pytest

from llamaspec import slot_state
from llamaspec.engine import Engine
from llamaspec.slot_file import SlotFileError
from llamaspec.testing.tiny_models import write_model

PROMPT = [(i * 7 + 3) % 64 for i in range(30)]
OTHER = [(i * 5 + 1) % 64 for i in range(12)]
N = 16


def _completion(http, prompt, slot: int, **kw) -> dict:
    r = http.post("/completion", json={"prompt": prompt, "id_slot": slot, "n_predict": N, "temperature": 0,
                                       "cache_prompt": True, "return_tokens": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from support.server import Server

    d = tmp_path_factory.mktemp("slots")
    (d / "files").mkdir()
    target = write_model("llama", d / "llama.gguf", n_ctx=1024)
    draft = write_model("llama-draft", d / "llama-draft.gguf", n_ctx=1024)
    srv = Server(["-m", str(target), "-md", str(draft), "--spec-type", "draft-simple", "--no-spec-draft-adaptive",
                  "-np", "2", "-c", "1024", "-b", "32", "-t", "1", "--slot-save-path", str(d / "files")],
                 d / "server.log")
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c, d / "files"
    srv.stop()


def test_save_erase_restore_reuses_the_cache_exactly(served):
    http, files = served
    first = _completion(http, PROMPT, 1)
    assert first["timings"]["prompt_n"] == len(PROMPT) and first["timings"]["draft_n"] > 0
    r = http.post("/slots/1?action=save", json={"filename": "slot1.bin"})
    n_cached = len(PROMPT) + N - 1  # the last sampled token is never decoded
    assert r.status_code == 200 and r.json()["n_saved"] == n_cached and r.json()["id_slot"] == 1
    assert r.json()["n_written"] == (files / "slot1.bin").stat().st_size and "save_ms" in r.json()["timings"]
    assert (files / "slot1.bin").read_bytes()[:4] == struct.pack("=I", 0x67677371)  # llama.cpp's 'ggsq'
    r = http.post("/slots/1?action=erase")
    assert r.json() == {"id_slot": 1, "n_erased": n_cached}
    again = _completion(http, PROMPT, 1)  # erased: the whole prompt again, same text
    assert again["timings"]["cache_n"] == 0 and again["tokens"] == first["tokens"]
    _completion(http, OTHER, 0)  # slot 0 holds something else
    r = http.post("/slots/0?action=restore", json={"filename": "slot1.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] == n_cached and r.json()["n_read"] > 0
    restored = _completion(http, PROMPT, 0)
    assert restored["timings"]["cache_n"] == len(PROMPT) - 1 and restored["timings"]["prompt_n"] == 1
    assert restored["tokens"] == first["tokens"]
    assert restored["timings"]["draft_n"] > 0  # the draft context caught up with the restored tokens
    slots = {s["id"]: s for s in http.get("/slots").json()}
    assert slots[0]["n_cached"] == n_cached


def test_legacy_token_list_restores(served):
    """A file whose token list is the plain one of older llama-servers (upstream's test_slot_save.py rewrite)."""
    http, files = served
    _completion(http, PROMPT, 1)
    assert http.post("/slots/1?action=save", json={"filename": "legacy.bin"}).status_code == 200
    data = bytearray((files / "legacy.bin").read_bytes())
    n_words = struct.unpack_from("=I", data, 8)[0]
    n_tokens = struct.unpack_from("=I", data, 12 + 8)[0]
    assert n_words == n_tokens + 4
    data = data[:12] + data[24:24 + 4 * n_tokens] + data[12 + 4 * n_words:]
    struct.pack_into("=I", data, 8, n_tokens)
    (files / "legacy.bin").write_bytes(bytes(data))
    r = http.post("/slots/0?action=restore", json={"filename": "legacy.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] == n_tokens
    assert _completion(http, PROMPT, 0)["timings"]["prompt_n"] == 1


@pytest.mark.parametrize("path,body,code,needle", [
    ("/slots/0?action=save", {"filename": "../escape.bin"}, 400, "Invalid filename"),
    ("/slots/0?action=save", {"filename": "a/b.bin"}, 400, "Invalid filename"),
    ("/slots/0?action=save", {"filename": ".."}, 400, "Invalid filename"),
    ("/slots/0?action=restore", {"filename": "x\\y"}, 400, "Invalid filename"),
    ("/slots/0?action=save", {}, 400, "Field 'filename'"),
    ("/slots/0?action=nope", {"filename": "x"}, 400, "Invalid action"),
    ("/slots/7?action=save", {"filename": "x"}, 400, "Invalid slot ID"),
    ("/slots/x?action=save", {"filename": "x"}, 400, "Invalid slot ID"),
    ("/slots/0?action=restore", {"filename": "missing.bin"}, 400, "Unable to restore slot"),
])
def test_bad_slot_actions(served, path, body, code, needle):
    http, files = served
    r = http.post(path, json=body)
    assert r.status_code == code and needle in r.json()["error"]["message"], r.text
    assert not (files.parent / "escape.bin").exists()


def test_a_bad_file_leaves_the_slot_empty(served):
    http, files = served
    _completion(http, PROMPT, 0)
    (files / "junk.bin").write_bytes(b"not a state file at all")
    r = http.post("/slots/0?action=restore", json={"filename": "junk.bin"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Unable to restore slot: ")
    assert _completion(http, PROMPT, 0)["timings"]["cache_n"] == 0


@pytest.mark.parametrize("cut", [0.5, 0.9, "header", "tokens"])
def test_a_truncated_file_is_refused_and_the_server_lives(served, cut):
    """A slot file cut short (llama.cpp would read past its end and abort the process: GGML_ASSERT(nread <=
    state_size)): 400, the slot left empty, the server serving on."""
    http, files = served
    _completion(http, PROMPT, 1)
    assert http.post("/slots/1?action=save", json={"filename": "whole.bin"}).status_code == 200
    data = (files / "whole.bin").read_bytes()
    n = {"header": 8, "tokens": 12 + 4 * 5}.get(cut) if isinstance(cut, str) else int(len(data) * cut)
    (files / "cut.bin").write_bytes(data[:n])
    for slot in (1, 0):
        r = http.post(f"/slots/{slot}?action=restore", json={"filename": "cut.bin"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("Unable to restore slot: "), r.text
    assert http.get("/health").status_code == 200
    assert _completion(http, PROMPT, 1)["timings"]["cache_n"] == 0  # left empty, usable
    (files / "long.bin").write_bytes(data + b"\0" * 64)  # trailing bytes: not a file llama.cpp wrote
    assert http.post("/slots/1?action=restore", json={"filename": "long.bin"}).status_code == 400
    assert http.post("/slots/1?action=restore", json={"filename": "whole.bin"}).status_code == 200


def test_refusals_name_no_server_path(served):
    """A refused restore says what is wrong with the file, never where the server keeps it."""
    http, files = served
    (files / "junk2.bin").write_bytes(b"ggsq" + b"\0" * 40)
    for name in ("junk2.bin", "missing.bin"):
        r = http.post("/slots/0?action=restore", json={"filename": name})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert str(files) not in msg and "/tmp" not in msg and name in msg, msg


def test_a_255_byte_filename_saves(served):
    http, files = served
    _completion(http, PROMPT, 0)
    name = "s" * 251 + ".bin"
    assert len(name.encode()) == 255
    r = http.post("/slots/0?action=save", json={"filename": name})
    assert r.status_code == 200, r.text
    assert http.post("/slots/0?action=restore", json={"filename": name}).status_code == 200
    assert http.post("/slots/0?action=save", json={"filename": "é" * 128}).status_code == 400  # 256 bytes


def test_an_error_carries_its_own_native_log_line(served):
    """A failed restore logs a llama.cpp error; a later bad grammar's 400 tells its own, not that one."""
    http, files = served
    (files / "junk3.bin").write_bytes(b"not a state file at all")
    assert http.post("/slots/0?action=restore", json={"filename": "junk3.bin"}).status_code == 400
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 1, "grammar": 'root ::= a\na ::= root "x"'})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "left recursion" in msg and "state" not in msg and "magic" not in msg, msg


def test_without_slot_save_path_501(tiny_models):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    with Engine(tiny_models["llama"], n_ctx=256) as eng:
        state = ServerState(ServerConfig(model_id="tiny", chat_template="chatml"), engine=eng)
        with TestClient(create_app(state)) as c:
            for action in ("save", "restore", "erase"):
                r = c.post(f"/slots/0?action={action}", json={"filename": "x"})
                assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
                assert "--slot-save-path" in r.json()["error"]["message"]


def test_slot_save_path_must_be_a_directory(tmp_path):
    from click.testing import CliRunner

    from llamaspec.cli.serve import serve

    r = CliRunner().invoke(serve, ["--slot-save-path", str(tmp_path / "nope")], catch_exceptions=False)
    assert r.exit_code == 2 and "not a directory" in r.output, r.output


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba"])
def test_engine_export_import(tiny_model, tmp_path, kind):
    """PART, SWA (iSWA cache) and FULL (recurrent) targets: a restored slot continues exactly. A FULL memory
    reuses only the whole cached sequence, and a restored SWA cache holds only the last window (a shorter
    prefix cannot be trimmed back, as in llama-server), so their next prompt extends the saved tokens."""
    with Engine(tiny_model(kind), n_ctx=512, n_parallel=2, cache_prompt=True) as eng:
        first = eng.generate(PROMPT, n_predict=N, id_slot=1)
        saved = eng.slot_store.save(1)
        assert list(saved.tokens) == PROMPT + first.tokens[:-1]
        n, n_bytes = eng.slot_store.save_file(1, tmp_path / "s.bin")
        assert n == len(saved.tokens) and n_bytes == (tmp_path / "s.bin").stat().st_size
        eng.generate(OTHER, n_predict=4, id_slot=0)
        nxt = PROMPT if kind == "llama" else PROMPT + first.tokens
        ref = eng.generate(nxt, n_predict=N, id_slot=1)  # slot 1 still holds the saved cache: the reference
        for restore in (lambda: eng.slot_store.restore(0, saved),
                        lambda: eng.slot_store.restore_file(0, tmp_path / "s.bin")):
            eng.generate(OTHER, n_predict=4, id_slot=0)
            restore()
            got = eng.generate(nxt, n_predict=N, id_slot=0)
            assert got.tokens == ref.tokens and got.stats.n_cached == ref.stats.n_cached > 0
        assert eng.slot_store.erase(0) == len(nxt) + N - 1
        assert eng.generate(nxt, n_predict=N, id_slot=0).stats.n_cached == 0


@pytest.mark.parametrize("reuse_kv", [True, False])
def test_restored_slot_with_a_draft_model(tiny_model, reuse_kv):
    """The draft context is not in the saved state: after a restore it is empty, and the next request decodes
    the reused prefix into it before its prompt goes on (with draft-KV reuse and with plain mirroring)."""
    from llamaspec.params import SpecParams

    spec = SpecParams()
    spec.add_types("draft-simple")
    spec.draft.n_max, spec.draft_adaptive, spec.draft.reuse_kv = 3, False, reuse_kv
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec, n_ctx=512, n_parallel=2,
                cache_prompt=True) as eng:
        first = eng.generate(PROMPT, n_predict=N, id_slot=1)
        saved = eng.slot_store.save(1)
        eng.generate(OTHER, n_predict=4, id_slot=0)
        eng.slot_store.restore(0, saved)
        got = eng.generate(PROMPT, n_predict=N, id_slot=0)
        assert got.tokens == first.tokens and got.stats.n_cached == len(PROMPT) - 1
        assert got.stats.n_drafted > 0 and got.stats.n_accepted == first.stats.n_accepted


def test_engine_import_refuses_bad_tokens(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256, cache_prompt=True) as eng:
        eng.generate(PROMPT, n_predict=4)
        saved = eng.slot_store.save(0)
        with pytest.raises(SlotFileError, match="Invalid tokens"):
            eng.slot_store.restore(0, slot_state.SavedSlot((*saved.tokens[:-1], 9999), saved.state))
        with pytest.raises(SlotFileError, match="positions"):
            eng.slot_store.restore(0, slot_state.SavedSlot(saved.tokens[:-1], saved.state))
        assert eng.generate(PROMPT, n_predict=4).stats.n_cached == 0  # left empty, usable


def test_compat_save_state_load_state(tiny_model):
    from llamaspec import Llama

    llm = Llama(str(tiny_model("llama")), draft_model=str(tiny_model("llama-draft")), n_ctx=256, verbose=False)
    try:
        a = llm(PROMPT, max_tokens=N, temperature=0)
        state = llm.save_state()
        assert state.n_tokens == len(PROMPT) + N - 1 and list(state.input_ids[:len(PROMPT)]) == PROMPT
        assert state.llama_state_size == len(state.llama_state) > 0 and len(state.slots) == 1
        llm(OTHER, max_tokens=4, temperature=0)  # the cache now holds something else
        llm.load_state(pickle.loads(pickle.dumps(state)))
        b = llm(PROMPT, max_tokens=N, temperature=0)
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert llm.last_report["n_cached"] == len(PROMPT) - 1
    finally:
        llm.close()


def test_slot_actions_on_a_busy_slot_stall_no_other_route(tiny_models, tmp_path, monkeypatch):
    """Slot actions waiting for a busy slot (a stream pinned to slot 0) do not hold the worker threads every
    other route shares: with 4 erases of slot 0 waiting, /tokenize still answers at once; an action that waits
    too long is a 503 with Retry-After (llama-server defers it; here it is bounded)."""
    import threading
    import time

    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server import slot_actions
    from llamaspec.server.app import ServerConfig, ServerState, create_app

    monkeypatch.setattr(slot_actions, "SLOT_WAIT_S", 0.5, raising=False)
    with Engine(tiny_models["llama"], n_ctx=512, n_parallel=2, cache_prompt=True) as eng:
        done = threading.Event()
        run = eng.round.run

        def slow_run(*a, **kw):  # ~50 tokens/s until the test is done with the slot
            if not done.is_set():
                time.sleep(0.02)
            return run(*a, **kw)

        eng.round.run = slow_run
        state = ServerState(ServerConfig(model_id="tiny", slot_save_path=str(tmp_path)), engine=eng)
        with TestClient(create_app(state)) as c:
            results: dict = {}
            stream = threading.Thread(target=lambda: results.setdefault("stream", c.post(
                "/completion", json={"prompt": PROMPT, "id_slot": 0, "n_predict": 400, "stream": True})))
            stream.start()
            deadline = time.monotonic() + 30
            while eng.scheduler.free(eng.slots[0]):  # until the stream holds slot 0
                assert time.monotonic() < deadline
                time.sleep(0.01)
            erases = [threading.Thread(target=lambda i=i: results.setdefault(i, c.post("/slots/0?action=erase")))
                      for i in range(4)]
            for t in erases:
                t.start()
            time.sleep(0.3)  # the erases are waiting for slot 0
            t0 = time.monotonic()
            r = c.post("/tokenize", json={"content": "hello world", "with_pieces": True})
            took = time.monotonic() - t0
            for t in erases:
                t.join(5)
            alive = stream.is_alive()
            done.set()
            stream.join(60)
        assert r.status_code == 200 and took < 2.0, took
        assert alive  # /tokenize answered and the erases gave up while the stream still held slot 0
        assert results["stream"].status_code == 200
        for i in range(4):  # a 503 the client can retry, not a wait as long as the stream
            assert results[i].status_code == 503, results[i].text
            assert results[i].headers.get("Retry-After") and "slot 0 is busy" in results[i].json()["error"]["message"]
