"""Pure pieces of the server: incremental detokenization, stop strings, the speculation
override, the per-request policy, metrics text."""

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
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return (text[:min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize("deltas,stops,want,hit", [
    (["Hello wor", "ld. Bye"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cd", "bc"], "a", True),  # the earliest occurrence wins
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


@pytest.mark.parametrize("server_rule,temp,opts,want", [
    ("rejection", 0.0, None, (True, "greedy", False)),
    ("rejection", 0.0, {"speculate": False}, (False, "greedy", False)),
    ("rejection", 0.0, {"rule": "typical-lossy"}, (True, "greedy", False)),  # greedy rows: argmax anyway
    ("rejection", 0.7, None, (True, "rejection", False)),
    ("rejection", 0.7, {"rule": "rejection", "speculate": False}, (False, "rejection", False)),
    ("typical-lossy", 0.7, None, (True, "typical-lossy", True)),  # flagged
    ("typical-lossy", 0.7, {"speculate": False}, (False, "typical-lossy", False)),
    ("typical-lossy", 0.7, {"rule": "rejection"}, (False, "rejection", False)),  # exact via k = 0
    ("rejection", 0.7, {"rule": "typical-lossy"}, 400),  # lossy only where the server enabled it
    ("rejection", 0.7, {"rule": "greedy"}, 400),  # greedy does not sample
    ("greedy", 0.7, None, 400),
    ("rejection", 0.0, {"rule": "nope"}, 400),
])
def test_resolve_speculation(server_rule, temp, opts, want):
    o = VerispecOptions(**opts) if opts else None
    if want == 400:
        with pytest.raises(OpenAIError) as e:
            resolve_speculation(server_rule, True, temp, o)
        assert e.value.status == 400 and e.value.param in ("verispec.rule", "temperature")
    else:
        s = resolve_speculation(server_rule, True, temp, o)
        assert (s.speculate, s.rule, s.lossy) == want
    if want != 400:
        assert resolve_speculation(server_rule, False, temp, o).speculate is False  # no drafter: never


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
