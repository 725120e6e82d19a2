"""Corruption signatures: pure functions on token ids and text."""

from verispec.audit.corruption import (Signatures, longest_char_run, new_signatures,
                                       repeated_ngram_fraction, signatures, tail_loop)


def test_tail_loop_finds_a_repeated_unit_at_the_end():
    assert tail_loop(list(range(10)) + [7, 8, 9, 1] * 4) == (4, 4)
    assert tail_loop([5] * 16) == (1, 16)
    assert tail_loop([1, 2] * 8 + [3]) is None  # the loop is not at the end
    assert tail_loop([1, 2, 3, 4] * 3) is None  # three repeats: not yet a loop
    assert tail_loop(list(range(40))) is None
    assert tail_loop([]) is None


def test_repeated_ngram_fraction():
    assert repeated_ngram_fraction(list(range(20))) == 0.0
    assert repeated_ngram_fraction([1, 2, 3]) == 0.0
    frac = repeated_ngram_fraction([1, 2, 3, 4] * 5)
    assert 0.7 < frac < 1.0


def test_longest_char_run():
    assert longest_char_run("ab" + "x" * 25 + "c") == (25, "x")
    assert longest_char_run("") == (0, "")
    assert longest_char_run("aabbb") == (3, "b")


def _sig(**kw) -> Signatures:
    base = dict(tokens=40, stopped=False, loop=None, repeated_fraction=0.0, char_run=3, char_run_char="a",
                perplexity=2.0)
    return Signatures(**{**base, **kw})


def test_clean_output_has_no_new_signature():
    assert new_signatures(_sig(), _sig()) == []


def test_each_signature_is_flagged_only_when_the_reference_lacks_it():
    ref = _sig()
    assert "repetition loop" in new_signatures(_sig(loop=(3, 6)), ref)[0]
    assert new_signatures(_sig(loop=(3, 6)), _sig(loop=(2, 9))) == []  # the model loops by itself
    assert "repeated 4-grams" in new_signatures(_sig(repeated_fraction=0.8), ref)[0]
    assert new_signatures(_sig(repeated_fraction=0.8), _sig(repeated_fraction=0.7)) == []
    assert "character run" in new_signatures(_sig(char_run=30, char_run_char="!"), ref)[0]
    assert new_signatures(_sig(char_run=30), _sig(char_run=24)) == []
    assert "perplexity" in new_signatures(_sig(perplexity=4.5), ref)[0]
    assert new_signatures(_sig(perplexity=3.9), ref) == []
    assert "early stop" in new_signatures(_sig(tokens=5, stopped=True), ref)[0]
    assert new_signatures(_sig(tokens=5, stopped=False), ref) == []  # cut by length, not a stop
    assert new_signatures(_sig(tokens=3, stopped=True), _sig(tokens=6)) == []  # short reference


def test_signatures_from_an_output():
    s = signatures([1, 2, 3, 4] * 5, "abc" + "=" * 22, stopped=True, perplexity=1.5)
    assert s.loop == (4, 5) and s.char_run == 22 and s.char_run_char == "=" and s.stopped
    assert s.to_dict()["perplexity"] == 1.5
