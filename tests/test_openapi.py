"""``GET /openapi.json`` (llamaspec/server/openapi.py): every route of the app is described and every described
route exists, the document is valid OpenAPI 3.1, its bounds are the server's (the loaded model's context,
slots and vocabulary, the ``--max-*`` limits), it is public under ``--api-key``, and the generation fields'
types and ranges (:data:`GEN_FIELDS`) are exactly what ``parse_gen_params`` accepts."""
from __future__ import annotations

import doctest

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from llamaspec.server import openapi as oa  # noqa: E402
from llamaspec.server.errors import ApiError  # noqa: E402
from llamaspec.server.limits import Limits  # noqa: E402
from llamaspec.server.parsing import Body, Defaults, parse_gen_params  # noqa: E402
from llamaspec.server.state import ServerConfig, ServerState  # noqa: E402
from helpers import tiny_draft_engine  # noqa: E402

BOUNDS = {"n_ctx": 256, "n_max": 4}


def _app(state: ServerState):
    from llamaspec.server.app import create_app

    return create_app(state)


def _operations(app) -> set[tuple[str, str]]:
    from starlette.routing import Route

    out = set()
    for r in app.routes:
        assert isinstance(r, Route), r
        out |= {(r.path, m.lower()) for m in r.methods if m != "HEAD"}
    return out


def test_every_route_is_described_and_every_description_is_a_route():
    app = _app(ServerState(ServerConfig()))
    doc = oa.describe(ServerConfig())
    described = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert _operations(app) == described
    assert ("/openapi.json", "get") in described
    ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))


def test_doctest():
    assert doctest.testmod(oa).failed == 0


def test_the_document_is_valid_openapi():
    schemathesis = pytest.importorskip("schemathesis")
    for cfg in (ServerConfig(), ServerConfig(api_keys=["k"], api_prefix="/p")):
        schema = schemathesis.openapi.from_dict(oa.describe(cfg))
        schema.validate()
        assert len(list(schema.get_all_operations())) == 25


def test_security_follows_the_api_keys_and_the_public_routes():
    from llamaspec.server.middleware import PUBLIC

    assert "security" not in oa.describe(ServerConfig())
    doc = oa.describe(ServerConfig(api_keys=["k"]))
    assert doc["security"] == [{"bearer": []}, {"apiKey": []}]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert (op.get("security") == []) == (path in PUBLIC), path
            assert ("401" in op["responses"]) == (path not in PUBLIC), path


def test_limits_go_into_the_schemas():
    doc = oa.describe(ServerConfig(limits=Limits(max_stop=3, max_stop_chars=7, max_prompt_chars=99)))
    s = doc["components"]["schemas"]
    stop = s["Completion"]["properties"]["stop"]["anyOf"]
    assert stop[0]["maxLength"] == 7 and stop[1]["maxItems"] == 3 and stop[1]["items"]["maxLength"] == 7
    assert s["Tokenize"]["properties"]["content"]["maxLength"] == 99


@pytest.fixture(scope="module")
def served(tiny_model):
    """The app on a tiny engine (2 slots, a draft of n_max 3), with an API key."""
    from starlette.testclient import TestClient

    eng = tiny_draft_engine(tiny_model, n_max=3)
    state = ServerState(ServerConfig(chat_template="chatml", api_keys=["k"]), engine=eng)
    with TestClient(_app(state)) as client:
        yield client, eng


def test_served_with_the_key_and_the_models_bounds(served):
    client, eng = served
    assert client.get("/openapi.json").status_code == 401  # the key is needed, as for llama-server's routes
    r = client.get("/openapi.json", headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert client.get("/props").status_code == 401  # the key is still needed elsewhere
    s = doc["components"]["schemas"]
    gen = s["Completion"]["properties"]
    assert gen["repeat_last_n"]["maximum"] == eng.n_ctx_seq
    assert gen["id_slot"]["maximum"] == 1
    assert gen["speculative.n_max"]["maximum"] == gen["speculative"]["properties"]["n_max"]["maximum"] == 3
    assert gen["n_probs"]["maximum"] == min(100, eng.vocab.n_tokens)
    assert s["Detokenize"]["properties"]["tokens"]["items"]["maximum"] == eng.vocab.n_tokens - 1
    slot = doc["paths"]["/slots/{id_slot}"]["post"]["parameters"][0]["schema"]
    assert slot["maximum"] == 1


# ------------------------------------------------------------------------------------------- GEN_FIELDS
def _parse(body: dict):
    return parse_gen_params(Body(body), Defaults(), n_ctx=BOUNDS["n_ctx"], limits=Limits(), tokenize=lambda t: [1])


def _speculative_checked(name: str, value) -> None:
    """``speculative.n_max`` is checked against the server's maximum when the request is submitted."""
    from llamaspec.errors import UsageError

    spec = _parse({name: value}).options.speculative
    try:
        if spec is not None:
            spec.validate(BOUNDS["n_max"])
    except UsageError as e:
        raise ApiError(400, str(e)) from None


def _accepts(name: str, value) -> bool:
    try:
        if name.startswith("speculative."):
            _speculative_checked(name, value)
        else:
            _parse({name: value})
    except ApiError as e:
        assert e.code == 400 and name in e.message, e.message
        return False
    return True


@pytest.mark.parametrize("name", sorted(oa.GEN_FIELDS))
def test_gen_field_types_and_ranges_are_the_servers(name):
    kind, *bounds = oa.GEN_FIELDS[name]
    lo, hi = (bounds + [None, None])[:2]
    if hi == "slot":  # checked when the request is submitted (test_schemathesis.py sends it to a server)
        hi = None
    hi = BOUNDS.get(hi, oa.I32_MAX) if isinstance(hi, str) else hi
    good = {"integer": 1, "number": 0.5, "boolean": True, "string": 'root ::= "a"'}[kind]
    assert _accepts(name, good) and _accepts(name, None)
    for wrong in ({"integer": ["x", 1.5, True], "number": ["x", True, [1]], "boolean": ["x", 1, 0],
                   "string": [1, True, ["a"]]}[kind]):
        assert not _accepts(name, wrong), (name, wrong)
    step = 1 if kind == "integer" else 0.001
    if lo is not None:
        assert _accepts(name, lo) and not _accepts(name, lo - step), (name, lo)
    if hi is not None:
        assert _accepts(name, hi) and not _accepts(name, hi + step), (name, hi)
    if kind == "integer" and lo is None:
        assert _accepts(name, oa.I32_MIN) and not _accepts(name, oa.I32_MIN - 1)


def test_aliases_are_checked_only_when_read():
    """``max_tokens`` is described under an ``if`` (n_predict and max_completion_tokens absent), as the server
    reads it: behind a valid ``n_predict`` a wrong ``max_tokens`` is ignored, alone it is a 400."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    doc = oa.describe(ServerConfig())
    v = jsonschema_rs.validator_for(doc["components"]["schemas"]["Completion"])
    for body in ({"prompt": "x", "n_predict": 5, "max_tokens": "x"}, {"prompt": "x", "n": 2, "n_cmpl": 99},
                 {"prompt": "x", "n_probs": 2, "logprobs": "x", "top_logprobs": -5}):
        assert v.is_valid(body)
        _parse(body)
    for body in ({"prompt": "x", "max_tokens": "x"}, {"prompt": "x", "n_predict": None, "max_tokens": -2},
                 {"prompt": "x", "n_cmpl": 99}, {"prompt": "x", "logprobs": "x"},
                 {"prompt": "x", "logprobs": True, "top_logprobs": 21}):
        assert not v.is_valid(body)
        with pytest.raises(ApiError):
            _parse(body)


# ------------------------------------------------------------------------------------------- found by the fuzzer
def test_a_nested_speculative_value_must_agree_in_type_with_the_flat_one():
    """Schemathesis's coverage case ``speculative -> n_max: Incorrect type`` next to a valid flat
    ``speculative.n_max`` was accepted: ``true == 1`` and ``false == 0`` in Python, so the two did not
    "disagree" and the nested boolean was never checked."""
    from llamaspec.server.parsing import parse_speculative

    for flat, nested in ((1, True), (0, False), (0.0, False), (1, "1")):
        for key in ("n_max", "n_min", "p_min"):
            with pytest.raises(ApiError, match="disagree"):
                parse_speculative(Body({f"speculative.{key}": flat, "speculative": {key: nested}}))
    spec = parse_speculative(Body({"speculative.n_max": 1, "speculative": {"n_max": 1.0, "p_min": 0.5}}))
    assert (spec.n_max, spec.p_min) == (1, 0.5)


def test_rejection_verify_of_a_distribution_with_no_mass(served):
    """Schemathesis's positive case on /v1/responses (found by scripts/fuzz_openapi.py --seed 11): a huge negative
    ``dry_multiplier`` with a huge ``dry_base`` makes a repeated token's logit +inf, the target's distribution NaN,
    and ``verify: rejection`` failed the request with a 500 ("p_tgt of row 0 has no mass"). Such a row is now
    the chain's own pick, as plain decoding's."""
    client, _ = served
    body = {"prompt": "hello", "n_predict": 24, "speculative.verify": "rejection", "min_keep": 3628801,
            "dry_multiplier": -2.8e16, "dry_base": 1e7, "seed": 3}
    for route, extra in (("/completion", {}), ("/v1/responses", {"input": "hi"})):
        b = {k: v for k, v in body.items() if not (extra and k == "prompt")} | extra
        r = client.post(route, json=b, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200, r.text
