"""The bug catalogue: enough real bugs, each citable, each tied to a registered check and a
known re-creation, its look-ups consistent, and its validation refusing what would mislead."""

from __future__ import annotations

import dataclasses

import pytest

from verispec.audit import known_bugs as kb
from verispec.audit.checks import REGISTRY, Check
from verispec.audit.registry import DISTRIBUTION

# the patch names tests/vllm_patches/ answers to, spelled here apart from the module so a
# rename on either side shows
FIXED = {"uninitialised-temperature", "counters-rejected-as-accepted", "relaxed-acceptance", "target-temperature-skipped", "bonus-only-filters",
         "penalties-skipped", "temperature-twice", "logprobs-placeholder", "logprobs-shifted",
         "counters-after-eos", "stop-leak", "max-tokens-overrun", "seed-ignored", "seed-misindexed",
         "recovered-from-target", "greedy-verify-sampled"}


def test_the_catalogue_holds_enough_real_bugs_most_of_them_re_created():
    assert len(kb.CATALOGUE) >= 18
    assert sum(e.recreated is not None for e in kb.CATALOGUE) >= 12


def test_cites_are_well_formed_and_unique():
    cites = [e.cite for e in kb.CATALOGUE]
    assert all(kb.CITE.match(c) for c in cites)
    assert len(set(cites)) == len(cites)
    assert len({e.slug for e in kb.CATALOGUE}) == len(kb.CATALOGUE)


def test_every_entry_names_a_known_server_class_and_re_creation():
    assert set(kb.recreations()) == FIXED
    for e in kb.CATALOGUE:
        assert e.server in kb.SERVERS and e.bug_class in kb.CLASSES
        assert e.recreated is None or e.recreated in FIXED
        assert bool(e.recreated) == bool(e.recreated_as) != bool(e.not_recreated)
        assert e.check in REGISTRY


def test_by_check_partitions_the_catalogue():
    seen = []
    for check in REGISTRY:
        found = kb.by_check(check)
        assert all(e.check is check for e in found)
        seen += found
    assert sorted(e.slug for e in seen) == sorted(e.slug for e in kb.CATALOGUE)


def test_by_recreation_gathers_every_re_created_entry_once():
    seen = [e for name in kb.recreations() for e in kb.by_recreation(name)]
    assert all(e.recreated in FIXED for e in seen)
    assert sorted(e.slug for e in seen) == sorted(e.slug for e in kb.CATALOGUE if e.recreated)
    assert kb.by_recreation("no-such-patch") == []


def test_the_uninitialised_temperature_re_creation_is_the_cpu_expand_bug():
    assert "vllm-project/vllm#55005" in {e.cite for e in kb.by_recreation("uninitialised-temperature")}


def _good():
    return kb.CATALOGUE[0]


@pytest.mark.parametrize("change", [
    {"cite": "vllm#10198"},
    {"cite": "https://github.com/vllm-project/vllm/pull/10198"},
    {"check": Check("not-a-registered-check")},
    {"check": dataclasses.replace(DISTRIBUTION)},  # equal in name, not the registered object
    {"bug_class": "distribution-ish"},
    {"server": "ollama"},
    {"recreated": "no-such-patch"},
    {"recreated": None},  # re-created by no patch, and no reason given
    {"recreated_as": ""},
])
def test_validation_refuses_a_misleading_entry(change):
    with pytest.raises(ValueError):
        kb.validate([dataclasses.replace(_good(), **change)])


def test_validation_refuses_a_repeated_slug_or_cite():
    with pytest.raises(ValueError):
        kb.validate([_good(), dataclasses.replace(_good(), slug="another-slug")])
    with pytest.raises(ValueError):
        kb.validate([_good(), dataclasses.replace(_good(), cite="owner/repo#1")])


def test_validation_accepts_the_catalogue():
    kb.validate(kb.CATALOGUE)
