"""Test and benchmark tooling that does not ship with llamaspec: fault injection (:mod:`.faults`), the load
runner (:mod:`.load_mix`, :mod:`.load_client`, :mod:`.load_run`), the OpenAPI fuzzer (:mod:`.openapi_fuzz`),
local RPC servers (:mod:`.rpc_servers`), a FIM-token GGUF copy (:mod:`.fim`) and the tiny EAGLE-3 / DFlash / MTP
fixtures (:mod:`.tiny_eagle`, :mod:`.tiny_mtp`).

Tests import it as ``support`` (pytest puts tests/ on ``sys.path``); scripts/ insert tests/ into ``sys.path``
first; its command lines run from the repository root with tests/ on the path
(``PYTHONPATH=tests python -m support.tiny_mtp OUTDIR``). The tiny random-weight models a user command needs (``llamaspec bench --quick``) stay in
the package: :mod:`llamaspec.testing.tiny_models`.
"""
