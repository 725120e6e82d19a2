"""Verification rules are honoured or refused, never silently substituted: on live servers
started with rejection, coupled and typical-lossy, each request is verified by the rule
its response reports (the worker refuses a request whose engine rule differs), and a
seeded request sampled with keyed noise gives exactly the tokens of seeded plain decoding
(offline, with the engine directly) whatever the server's drafter does."""

import httpx
import pytest

from tests.server.helpers import MODEL, CharTokenizer, LiveServer, make_state, plain_reference
from verispec.sampling import SamplingParams

PROMPT = "The quick brown fox"
BASE = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95}


@pytest.fixture(scope="module", params=["rejection", "coupled", "typical-lossy"])
def server(request):
    with LiveServer(make_state(drafter="draft", k=3, rule=request.param)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            yield request.param, c, s


def _post(c, **kw):
    body = {**BASE, **kw}
    return c.post("/v1/completions", json={k: v for k, v in body.items() if v is not None})


def _keyed_reference(seed: int, **sampling) -> str:
    tok = CharTokenizer()
    sp = SamplingParams(temperature=BASE["temperature"], top_p=BASE["top_p"], seed=seed, coupled=True, **sampling)
    out, _ = plain_reference([tok.encode(PROMPT)], [BASE["max_tokens"]], sampling=[sp])[0]
    return tok.decode(out, skip_special_tokens=True)


# (server rule, request: seed / verispec options, reported rule or an expected 400)
CASES = [
    ("rejection", None, None, "rejection"),
    ("rejection", 11, None, "coupled"),  # seeded: keyed noise by default
    ("rejection", 11, {"rule": "coupled"}, "coupled"),
    ("rejection", None, {"rule": "coupled"}, 400),
    ("rejection", 11, {"rule": "rejection"}, "rejection"),
    ("coupled", None, None, "coupled"),
    ("coupled", 11, None, "coupled"),
    ("coupled", None, {"rule": "rejection"}, "rejection"),
    ("coupled", 11, {"rule": "rejection"}, "rejection"),
    ("coupled", None, {"rule": "coupled"}, 400),
    ("typical-lossy", None, None, "typical-lossy"),
    ("typical-lossy", 11, None, "typical-lossy"),
    ("typical-lossy", 11, {"rule": "rejection"}, "rejection"),
    ("typical-lossy", 11, {"rule": "coupled"}, 400),
    ("rejection", None, {"rule": "typical-lossy"}, 400),
]


def test_rules(server):
    rule, c, _ = server
    for server_rule, seed, opts, want in CASES:
        if server_rule != rule:
            continue
        r = _post(c, seed=seed, verispec=opts)
        if want == 400:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "verispec.rule" and err["message"]
            if seed is None and opts == {"rule": "coupled"}:
                assert "needs a seed" in err["message"]
            continue
        assert r.status_code == 200, (seed, opts, r.text)
        info = r.json()["verispec"]
        assert info["rule"] == want, (seed, opts, info)
        assert info["lossy"] == (want == "typical-lossy" and info["speculate"])
        if want == "rejection" and rule == "typical-lossy":
            assert info["speculate"] is False and info["drafted"] == 0  # exact via k = 0


def test_seeded_requests_give_the_tokens_of_seeded_plain_decoding(server):
    """Keyed noise: with drafts (the server's drafter), without (speculate false) and offline
    plain decoding, the same seed gives the same text."""
    rule, c, _ = server
    if rule == "typical-lossy":
        pytest.skip("a typical-lossy server verifies seeded requests with its own (lossy) rule")
    for seed, extra in ((11, {}), (2 ** 64 - 1, {}), (-(2 ** 63), {}), (5, {"top_k": 20, "min_p": 0.05})):
        want = _keyed_reference(seed, **extra)
        spec = _post(c, seed=seed, verispec={"rule": "coupled"}, **extra).json()
        plain = _post(c, seed=seed, verispec={"speculate": False}, **extra).json()
        assert spec["verispec"]["rule"] == plain["verispec"]["rule"] == "coupled"
        assert spec["choices"][0]["text"] == plain["choices"][0]["text"] == want, (seed, extra)
    assert spec["verispec"]["drafted"] > 0  # the speculative one did draft


def test_rejection_with_a_seed_is_not_keyed(server):
    """rule "rejection" with a seed samples with a generator seeded from it, as asked: not the
    keyed tokens (over a few seeds, at least one differs from the keyed reference)."""
    rule, c, _ = server
    texts = []
    for seed in (1, 2, 3, 4):
        r = _post(c, seed=seed, verispec={"rule": "rejection", "speculate": False}).json()
        assert r["verispec"]["rule"] == "rejection"
        texts.append((r["choices"][0]["text"], _keyed_reference(seed)))
    assert any(a != b for a, b in texts)


def test_a_rule_the_engine_would_not_run_is_refused(server):
    """The worker compares the resolved rule with Engine.rule_for: an engine that would
    verify the row otherwise gets the request refused (500), never served as reported."""
    rule, c, s = server
    engine = s.state.engine
    original = engine.rule_for
    engine.rule_for = lambda r: "greedy" if r.params.sampling.greedy else "typical-lossy-elsewhere"
    try:
        r = _post(c, seed=3)
    finally:
        engine.rule_for = original
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "rule_mismatch" and "refused" in err["message"]
    ok = _post(c, seed=3)
    assert ok.status_code == 200
    assert c.get("/health").json() == {"status": "ok"}
