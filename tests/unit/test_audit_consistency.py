"""Drafter consistency on hand-made traces (prompt lookup: exact integer logic)."""

from verispec.audit.consistency import Oracle, check_request
from verispec.engine import GenerationParams, Request

LOOKUP = Oracle("lookup", max_ngram=3)


def _request(trace, output=(3, 1, 2, 3, 9)):
    r = Request([1, 2, 3, 1, 2], GenerationParams(max_new_tokens=5))
    r.output_ids = list(output)
    r.stats.trace = trace
    return r


def test_correct_lookup_trace_matches():
    # step 0: the prefix ends in [1, 2], seen at the start followed by [3, 1, 2]: all accepted,
    # plus a bonus token; step 1: one token left, so the engine asks for no drafts
    r = _request([(5, [3, 1, 2], 3, 3), (9, [], 0, 0)])
    compared, ties, bad = check_request(LOOKUP, r, k=3, logits_cache={})
    assert (compared, ties, bad) == (3, 0, [])


def test_wrong_draft_token_is_a_mismatch():
    r = _request([(5, [3, 1, 5], 2, 3), (9, [], 0, 0)])
    compared, _, bad = check_request(LOOKUP, r, k=3, logits_cache={})
    assert compared == 3 and len(bad) == 1
    assert bad[0]["drafted"] == 5 and bad[0]["expected"] == 2 and bad[0]["position"] == 7


def test_too_few_drafts_is_a_mismatch():
    r = _request([(5, [3, 1], 2, 3), (8, [3], 1, 1)])
    _, _, bad = check_request(LOOKUP, r, k=3, logits_cache={})
    assert len(bad) == 1 and "a correct drafter finds 3" in bad[0]["why"]


def test_only_accepted_drafts_and_the_first_rejection_are_compared():
    # one accepted draft: draft 0 and draft 1 (the rejected one) are compared, draft 2 is not
    r = _request([(5, [3, 1, 2], 1, 3), (7, [], 0, 0)], output=(3, 7, 2, 3, 9))
    compared, _, bad = check_request(LOOKUP, r, k=3, logits_cache={})
    assert compared == 2 and bad == []


# -- the whole check: which runs it reads, and a check that compared nothing ------------------

def _ctx():
    from types import SimpleNamespace

    from verispec.audit.progress import NullProgress
    from verispec.drafters.lookup import PromptLookupDrafter
    config = SimpleNamespace(policy="adaptive", forced_k=3, k=3)
    return SimpleNamespace(config=config, model=None, progress=NullProgress(),
                           drafter_factory=lambda rows, max_len: PromptLookupDrafter(max_ngram=3),
                           prompts=[SimpleNamespace(id="p0")])


def _runs(deployed_trace, forced_trace=None):
    from verispec.audit.context import GreedyRuns
    forced = None if forced_trace is None else (4, [_request(forced_trace)])
    return GreedyRuns(reference=[_request([])], speculative={1: [_request(deployed_trace)]}, forced=forced)


NO_DRAFTS = [(5, [], 0, 0), (6, [], 0, 0), (7, [], 0, 0), (8, [], 0, 0), (9, [], 0, 0)]


def test_a_check_that_compared_no_draft_is_inconclusive():
    """An adaptive policy that drafted nothing (layer-skip on SmolLM2 did, at the quick audit's
    24 tokens) leaves nothing to compare: that proves nothing about the drafter, and fails."""
    from verispec.audit.consistency import drafter_consistency_check
    res = drafter_consistency_check(_ctx(), _runs(NO_DRAFTS))
    assert not res.passed and res.summary.startswith("INCONCLUSIVE")
    assert res.figures["positions_compared"] == 0


def test_the_forced_run_is_compared_too():
    """A stale drafter whose proposals only the run with drafting forced shows fails the check,
    named by that run's policy; a correct forced run passes it."""
    from verispec.audit.consistency import drafter_consistency_check
    stale = drafter_consistency_check(_ctx(), _runs(NO_DRAFTS, [(5, [3, 1, 5], 2, 3), (9, [], 0, 0)]))
    assert not stale.passed and stale.figures["mismatches"] == 1
    assert stale.details["mismatches"][0]["policy"] == "fixed k=3"
    good = drafter_consistency_check(_ctx(), _runs(NO_DRAFTS, [(5, [3, 1, 2], 3, 3), (9, [], 0, 0)]))
    assert good.passed and good.figures["positions_compared"] == 3
    assert [r["policy"] for r in good.details["per_batch"]] == ["adaptive", "fixed k=3"]
