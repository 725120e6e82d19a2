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
