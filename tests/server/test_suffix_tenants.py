"""Suffix decoding behind several API keys: each key is a tenant, and the global cache
drafts for a request only from text sent with the same key (a cache shared across tenants
is a timing side channel: acceptance speed would reveal another tenant's text)."""

import httpx

from tests.server.helpers import MODEL, LiveServer, make_state
from verispec.drafters.suffix_tree import scope_of

KEYS = ("sk-tenant-a", "sk-tenant-b")
PROMPT = "the cat sat on the mat; the cat sat on the mat; the cat"


def _complete(c, key):
    r = c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
               json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_two_keys_never_receive_drafts_from_each_others_text():
    state = make_state(drafter="suffix", api_key=KEYS)
    cache = state.engine.drafter.cache
    calls = []
    real = cache.propose

    def recording(scope, context, max_tokens, **kw):
        p = real(scope, context, max_tokens, **kw)
        calls.append((scope, list(p.tokens)))
        return p

    cache.propose = recording
    a, b = scope_of(KEYS[0]), scope_of(KEYS[1])
    with LiveServer(state) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        text_a = _complete(c, KEYS[0])
        assert cache.stats()["sequences"] == 1 and calls and {sc for sc, _ in calls} == {a}
        calls.clear()
        # tenant b sends the very text tenant a sent: the cache holds it, but not for b
        text_b = _complete(c, KEYS[1])
        assert calls and {sc for sc, _ in calls} == {b}
        assert all(toks == [] for _, toks in calls)  # b's scope held nothing yet
        calls.clear()
        # tenant a again: its own earlier request is drafted from (the cache works)
        assert _complete(c, KEYS[0]) == text_a
        assert {sc for sc, _ in calls} == {a} and any(toks for _, toks in calls)
        assert c.post("/v1/completions", headers={"Authorization": "Bearer sk-other"},
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 401
        # /metrics reports the cache against its bound (what a soak watches)
        m = c.get("/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"}).text
        values = {line.partition("{")[0]: float(line.rpartition(" ")[2]) for line in m.splitlines()
                  if line.startswith("verispec_suffix_cache_")}
        st = cache.stats()
        assert values["verispec_suffix_cache_nodes"] == st["nodes"] > 0
        assert values["verispec_suffix_cache_max_nodes"] == st["max_nodes"]
        assert values["verispec_suffix_cache_sequences"] == 3 and values["verispec_suffix_cache_scopes"] == 2
    assert text_b == text_a  # greedy: the drafts change the speed, never the text
    st = cache.stats()
    assert st["scopes"] == 2 and st["sequences"] == 3
