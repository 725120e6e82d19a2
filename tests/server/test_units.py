"""Pure pieces of the server: incremental detokenization, stop strings, the speculation
override, the per-request policy, metrics text."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.server.helpers import metric
from verispec.engine import GenerationParams
from verispec.policy import FixedK
from verispec.server.metrics import Metrics
from verispec.server.protocol import OpenAIError, VerispecOptions, resolve_speculation
from verispec.server.text import IncrementalDecoder, StopStrings
from verispec.server.worker import PerRequestPolicy, ServerRequest


class ByteTokenizer:
    """Token = one UTF-8 byte (ids 0..255), 256 = EOS: characters span several tokens."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def test_decoder_never_splits_a_character():
    text = "héllo 日本語 🙂 ok"
    dec = IncrementalDecoder(ByteTokenizer())
    deltas = [dec.add([b]) for b in text.encode("utf-8")] + [dec.add([256]), dec.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[text.encode().index("日".encode())] == ""  # first byte of a 3-byte character: held


def test_decoder_flushes_an_incomplete_character():
    dec = IncrementalDecoder(ByteTokenizer())
    assert dec.add(list(b"ab")) == "ab"
    assert dec.add(["日".encode()[0]]) == ""
    assert dec.flush() == "\ufffd"


def _cut(text, stops):
    """The reference: cut before the stop occurrence that ends first (a token-by-token
    generator meets it first); among those ending at the same character, the longest."""
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if s and text.endswith(s, 0, end)]
        if ending:
            return text[:end - max(ending)], True
    return text, False


@pytest.mark.parametrize("deltas,stops,want,hit", [
    (["Hello wor", "ld. Bye"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cd", "bc"], "a", True),  # the occurrence that ends first wins
    (["abc", "a"], ["abca", "bc"], "a", True),  # "bc" completes before "abca" could
    (["xabc"], ["c", "abc"], "x", True),  # same end: the longest
    (["a", "b", "c"], ["abd"], "abc", False),
    (["xx", "y"], ["xyz"], "xxy", False),  # a held tail that never became a stop is sent at the end
    (["a\n", "\nb"], ["\n\n"], "a", True),
    (["no stop"], [], "no stop", False),
])
def test_stop_strings(deltas, stops, want, hit):
    s = StopStrings(stops)
    out, got_hit = "", False
    for i, d in enumerate(deltas):
        o, got_hit = s.feed(d, final=i == len(deltas) - 1)
        out += o
        if got_hit:
            break
    assert (out, got_hit) == (want, hit)


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=3))
def test_stop_strings_property(text, cuts, stops):
    """Streamed pieces concatenate to the text cut at the first stop; nothing sent is taken back."""
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    s, out, hit = StopStrings(stops), "", False
    for i, p in enumerate(pieces):
        o, hit = s.feed(p, final=i == len(pieces) - 1)
        out += o
        assert _cut(text, stops)[0].startswith(out)  # a prefix of the final answer at every step
        if hit:
            break
    assert (out, hit) == _cut(text, stops)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab", max_size=60), cuts=st.lists(st.integers(0, 60), max_size=10),
       stops=st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=4))
def test_stop_strings_do_not_depend_on_the_split(text, cuts, stops):
    """Whole or in pieces, the same text and the same hit: the answer is a function of the text."""
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    s, out, hit = StopStrings(stops), "", False
    for i, p in enumerate(pieces):
        o, hit = s.feed(p, final=i == len(pieces) - 1)
        out += o
        if hit:
            break
    whole = StopStrings(stops)
    assert (out, hit) == whole.feed(text, final=True) == _cut(text, stops)
    assert s.text == out


def test_stop_strings_cost_is_linear():
    """16 adversarial stop strings of the maximum length (a^255 b: every tail of a long
    run of a's is a prefix of each) against 20,000 one-character deltas of 'a': the old
    matcher re-scanned every stop prefix per delta (~80 M endswith calls); the automaton
    does a few steps per stop and character. The held tail stays under one stop length."""
    from verispec.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
    stops = ["a" * (MAX_STOP_CHARS - 1) + chr(ord("b") + i) for i in range(MAX_STOP_STRINGS)]
    s = StopStrings(stops)
    t0 = time.perf_counter()
    sent = 0
    for _ in range(20_000):
        out, hit = s.feed("a")
        assert not hit and len(s._held) <= MAX_STOP_CHARS - 1
        sent += len(out)
    out, hit = s.feed("b")  # completes the first stop: everything before its a-run is the answer
    elapsed = time.perf_counter() - t0
    assert hit and sent + len(out) == 20_000 - (MAX_STOP_CHARS - 1)
    assert s.text == "a" * (20_000 - (MAX_STOP_CHARS - 1))
    assert elapsed < 10.0, f"{elapsed:.1f} s for 20,000 deltas"


def test_decoder_holds_invalid_bytes_a_bounded_time():
    """Bytes that never form a character (lone continuation bytes) are not held forever:
    after MAX_HELD_TOKENS the decoder sends them as U+FFFD; nothing sent is repeated."""
    from verispec.server.text import MAX_HELD_TOKENS
    dec = IncrementalDecoder(ByteTokenizer())
    deltas = [dec.add([0x80]) for _ in range(3 * MAX_HELD_TOKENS)]
    assert any(deltas)
    assert max(len(d) for d in deltas) <= MAX_HELD_TOKENS + 1
    assert set("".join(deltas)) == {"\ufffd"}
    rest = dec.add(list(b"ok")) + dec.flush()
    assert rest.endswith("ok") and "".join(deltas) + rest == ByteTokenizer().decode(dec.ids)
    assert len(dec.ids) - dec.prefix <= MAX_HELD_TOKENS + 2  # decoding restarts near the end


S = 7  # a seed


@pytest.mark.parametrize("server_rule,temp,opts,seed,want", [
    ("rejection", 0.0, None, None, (True, "greedy", False, False)),
    ("rejection", 0.0, {"speculate": False}, None, (False, "greedy", False, False)),
    ("rejection", 0.0, {"rule": "typical-lossy"}, None, (True, "greedy", False, False)),  # greedy: argmax anyway
    ("rejection", 0.0, {"rule": "coupled"}, None, (True, "greedy", False, False)),
    ("rejection", 0.7, None, None, (True, "rejection", False, False)),
    ("rejection", 0.7, None, S, (True, "coupled", False, True)),  # seeded: keyed noise by default
    ("rejection", 0.7, {"rule": "coupled"}, S, (True, "coupled", False, True)),
    ("rejection", 0.7, {"rule": "coupled"}, None, 400),  # keyed noise needs a seed
    ("rejection", 0.7, {"rule": "rejection"}, S, (True, "rejection", False, False)),  # generator from the seed
    ("rejection", 0.7, {"rule": "rejection", "speculate": False}, None, (False, "rejection", False, False)),
    ("coupled", 0.7, None, None, (True, "coupled", False, True)),  # the server keys it on a fresh seed
    ("coupled", 0.7, None, S, (True, "coupled", False, True)),
    ("coupled", 0.7, {"rule": "rejection"}, None, (True, "rejection", False, False)),
    ("coupled", 0.7, {"rule": "coupled"}, None, 400),
    ("typical-lossy", 0.7, None, None, (True, "typical-lossy", True, False)),  # flagged
    ("typical-lossy", 0.7, None, S, (True, "typical-lossy", True, False)),  # its own rule, seeded or not
    ("typical-lossy", 0.7, {"speculate": False}, None, (False, "typical-lossy", False, False)),
    ("typical-lossy", 0.7, {"rule": "rejection"}, S, (False, "rejection", False, False)),  # exact via k = 0
    ("typical-lossy", 0.7, {"rule": "coupled"}, S, 400),  # it would verify the row its own way
    ("rejection", 0.7, {"rule": "typical-lossy"}, None, 400),  # lossy only where the server enabled it
    ("rejection", 0.7, {"rule": "greedy"}, None, 400),  # greedy does not sample
    ("greedy", 0.7, None, None, 400),
    ("rejection", 0.0, {"rule": "nope"}, None, 400),
])
def test_resolve_speculation(server_rule, temp, opts, seed, want):
    o = VerispecOptions(**opts) if opts else None
    if want == 400:
        with pytest.raises(OpenAIError) as e:
            resolve_speculation(server_rule, True, temp, o, seed=seed)
        assert e.value.status == 400 and e.value.param in ("verispec.rule", "temperature")
        if opts and opts.get("rule") == "coupled" and seed is None:
            assert "needs a seed" in e.value.message
        return
    s = resolve_speculation(server_rule, True, temp, o, seed=seed)
    assert (s.speculate, s.rule, s.lossy, s.keyed) == want
    no_drafter = resolve_speculation(server_rule, False, temp, o, seed=seed)
    assert no_drafter.speculate is False and not no_drafter.lossy  # no drafter: never drafts
    assert (no_drafter.rule, no_drafter.keyed) == (s.rule, s.keyed)


@pytest.mark.parametrize("server_rule", ["rejection", "coupled", "typical-lossy"])
@pytest.mark.parametrize("opts", [None, {"rule": "rejection"}, {"rule": "coupled"}, {"speculate": False},
                                  {"rule": "typical-lossy"}])
@pytest.mark.parametrize("seed", [None, S])
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_resolved_rule_is_the_engines(server_rule, opts, seed, temp):
    """What resolve_speculation reports is what Engine.rule_for says verifies the row, for
    the SamplingParams the server builds from it (the worker refuses a request otherwise)."""
    from dataclasses import replace

    from tests.server.helpers import target_model
    from verispec.engine import Engine, EngineConfig, Request
    from verispec.sampling import SamplingParams
    from verispec.server.protocol import same_rule
    o = VerispecOptions(**opts) if opts else None
    try:
        spec = resolve_speculation(server_rule, True, temp, o, seed=seed)
    except OpenAIError:
        return
    if seed is None and temp > 0 and server_rule == "coupled":
        seed = 123  # what the server does: a seed from OS entropy
    sp = SamplingParams(temperature=temp, seed=seed, coupled=spec.keyed)
    eng = Engine(target_model(), None, FixedK(0), EngineConfig(max_batch=1, max_len=16, rule=server_rule))
    req = Request([1, 2], replace(GenerationParams(max_new_tokens=4), sampling=sp))
    eng.add(req)  # the engine may settle the request's randomness here
    assert same_rule(spec.rule, eng.rule_for(req), spec.speculate), (spec, eng.rule_for(req))


def test_per_request_policy():
    pol = PerRequestPolicy(FixedK(4))
    reqs = [ServerRequest([1], GenerationParams(), speculate=s) for s in (True, False, True)]
    assert pol.max_k == 4
    assert pol.choose(reqs) == [4, 0, 4]


def test_metrics_text():
    m = Metrics("tiny", {"drafter": "draft", "k": "3", "rule": "rejection", "lossy": "false"})
    m.http_response("/v1/completions", 200)
    m.http_response("/v1/completions", 429)
    m.step(0.003, 4)
    m.tokens(generated=10, passes=4, drafts=4, drafted=12, accepted=6)
    m.request_end("length", 7, [4, 4, 4], [3, 2, 1])
    m.gauges(queue_depth=2, running=1, rows_in_use=1)
    text = m.render()
    assert metric(text, "verispec_requests_total", status="429") == 1
    assert metric(text, "verispec_spec_decode_acceptance_rate") == 0.5
    assert metric(text, "verispec_spec_decode_mean_accepted_length") == 2.5
    assert metric(text, "verispec_spec_decode_acceptance_per_position", position="2") == 0.25
    assert metric(text, "verispec_step_duration_seconds_bucket", le="0.005") == 1
    assert metric(text, "verispec_step_duration_seconds_bucket", le="0.001") == 0
    assert metric(text, "verispec_num_requests_waiting") == 2
    assert metric(text, "verispec_cache_rows_in_use") == 1
