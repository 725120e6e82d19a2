"""Corruption from outside (audit/corruption._endpoint_corruption): signatures on the reference's
tokens, judged against the deployment's own null. A correct server whose reference diverges
from itself the same way is not accused; a looping or garbled output still fails."""

from verispec.audit.endpoint.client import EndpointRun, LevelRun, PromptResult
from verispec.audit.corruption import MIN_SIGNATURE_TOKENS, _endpoint_corruption, _Signer
from verispec.audit.suite import SuitePrompt


class FakeTokens:
    """A reference that tokenizes by characters and scores from a table (text -> perplexity)."""
    unit = "the reference's tokens (fake)"

    def __init__(self, ppl=None):
        self.ppl = ppl or {}
        self.scored = []

    def tokenize(self, text):
        return [ord(c) for c in text]

    def perplexity(self, prompt, chat, ids):
        text = "".join(chr(i) for i in ids)
        self.scored.append(text)
        return self.ppl.get(text, 1.5)


def _run(texts, level=8):
    res = [PromptResult(f"p{i}", "s", text=t, finish_reason="stop") for i, t in enumerate(texts)]
    return EndpointRun("http://x", "m", "llama.cpp", True, [LevelRun(level, 1.0, res, None)])


PROMPTS = [SuitePrompt(f"p{i}", "s", f"prompt {i}") for i in range(3)]
BASE = ["I'm sorry, but I can't assist with that request. Is there anything else?",
        "The three primary colours are red, yellow and blue, mixed to make the rest.",
        "Paris is the capital of France and its largest city by population."]


def _check(endpoint, null, ppl=None):
    base = _run(BASE, 1).levels[0].results
    return _endpoint_corruption(_run(endpoint), base, [_run(null)], _Signer(FakeTokens(ppl), PROMPTS, True)).to_dict()


def test_an_output_the_reference_itself_produced_is_not_corruption():
    # the reported false alarm: the speculative server and the plain reference at c = 8 both
    # answered the shorter refusal; scored as improbable, it still is the reference's own text
    short = "I'm sorry, but I can't assist with that."
    endpoint = [short] + BASE[1:]
    c = _check(endpoint, [short] + BASE[1:], ppl={short: 9.0})
    assert c["passed"], c["summary"]
    assert c["figures"]["explained_by_null"] in (0, 1) and c["figures"]["flagged"] == 0


def test_a_short_answer_is_not_judged_on_perplexity():
    short = "I'm sorry."  # fewer than MIN_SIGNATURE_TOKENS tokens
    assert len(short) < MIN_SIGNATURE_TOKENS
    c = _check([short + " " * 0] + BASE[1:], BASE, ppl={short: 50.0})
    # an early stop is still a signature of its own (the base ran 70+ tokens): not a perplexity flag
    assert all("perplexity" not in s for r in c["details"]["flagged"] for s in r["signatures"])


def test_a_loop_fails_when_the_null_never_loops():
    loop = "The three primary colours are " + "red red red red " * 6
    c = _check([BASE[0], loop, BASE[2]], BASE)
    assert not c["passed"] and c["figures"]["flagged"] == 1
    row = c["details"]["flagged"][0]
    assert row["id"] == "p1" and any("loop" in s for s in row["signatures"]) and row["reference"] == BASE[1]
    assert "beyond the null" not in c["summary"] and "the null does not explain" in c["summary"]


def test_garbled_text_fails_on_the_references_perplexity_and_a_null_as_bad_explains_it():
    garbled = "Paris is the capital of qx7 zorblat vintage, mmph gloop frantically ok."
    c = _check([BASE[0], BASE[1], garbled], BASE, ppl={garbled: 12.0})
    assert not c["passed"] and any("perplexity" in s for s in c["details"]["flagged"][0]["signatures"])
    # the deployment's own null diverges into text the reference finds worse still: numerics, not a bug
    worse = "Paris is the capital of zzq qqq vvv wibble wobble flumph, said nobody at all."
    c = _check([BASE[0], BASE[1], garbled], [BASE[0], BASE[1], worse], ppl={garbled: 12.0, worse: 20.0})
    assert c["passed"] and c["figures"]["explained_by_null"] == 1 and c["figures"]["null_worst"]["perplexity"] > 8


def test_a_verispec_reference_scores_a_text_with_its_prompt_logprobs_never_the_endpoints_own():
    """ReferenceTokens on a verispec reference: the text's ids from its /tokenize, the
    perplexity from prompt_logprobs over the chat prompt's ids plus those, whatever logprobs
    the audited endpoint sent with its answer."""
    import math

    import httpx

    from tests.server.helpers import LiveServer, make_state
    from verispec.audit.endpoint.client import EndpointConfig
    from verispec.audit.endpoint.tokens import ReferenceTokens

    with LiveServer(make_state(drafter=None)) as s:
        toks = ReferenceTokens(EndpointConfig(s.url), "verispec")
        try:
            text = "the cat sat on the mat"
            ids = toks.tokenize(text)
            assert ids and len(ids) == len(text)  # CharTokenizer: one id a character
            msgs = [{"role": "user", "content": "say it"}]
            prompt = httpx.post(s.url + "/tokenize", json={"messages": msgs}).json()["tokens"]
            pl = httpx.post(s.url + "/v1/completions", json={"prompt": prompt + ids, "max_tokens": 1,
                                                             "prompt_logprobs": 0}).json()["choices"][0]
            lps = [pl["prompt_logprobs"][len(prompt) + j][str(t)]["logprob"] for j, t in enumerate(ids)]
            assert toks.perplexity("say it", True, ids) == math.exp(-sum(lps) / len(lps))
            garbled = toks.tokenize("tthe cacat sat sat ee mmmat")
            assert toks.perplexity("say it", True, garbled) > toks.perplexity("say it", True, ids)
        finally:
            toks.close()
