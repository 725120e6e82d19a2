"""The speedup-floor search on a fake deployment whose acceptance and timing are functions of
the prompt: the search is seeded and reproducible, it finds what lowers acceptance, the
quality bound keeps degraded outputs out of the floor, and --min-speedup gates on the
interval, not on the point estimate."""

import random

import pytest

from verispec.audit import mutate
from verispec.audit.floor import Candidate, FloorBudget, Subject, Trial, floor_result
from verispec.audit.progress import NullProgress
from verispec.audit.suite import SuitePrompt

SEEDS = [SuitePrompt(f"{s}-{i}", s, f"{s} task number {i}: explain the widget parser and its cache")
         for s in ("code", "chat", "math") for i in range(3)]


class FakeDeployment(Subject):
    """Acceptance falls with every trap and script edit; speculative time per token follows
    acceptance (a pass over k=4 drafts costs 2 decodes), with seeded multiplicative noise.
    Prompts asking for runes come out as garbage (high perplexity)."""

    acceptance_source = "fake record"
    reproducible = True

    def __init__(self, noise: float = 0.0, seed: int = 0):
        self.noise, self.rng = noise, random.Random(seed)

    def _acceptance(self, text: str) -> float:
        return max(0.0, 0.8 - 0.3 * text.count("more lines of the form") - 0.2 * text.count("Write your whole answer"))

    def pair(self, c: Candidate, spec_first: bool) -> Trial:
        a = self._acceptance(c.text)
        tokens_per_pass = 1 + 4 * a
        spec_spt = 2.0 / tokens_per_pass
        jitter = (lambda: 1 + self.rng.uniform(-self.noise, self.noise))
        return Trial(1.0 * 32 * jitter(), spec_spt * 32 * jitter(), 32, 32, spec_first)

    def evaluate(self, c: Candidate, spec_first: bool) -> None:
        c.trials.append(self.pair(c, spec_first))
        a = self._acceptance(c.text)
        c.tokens, c.drafted = 32, 40
        c.accepted = round(40 * a)
        c.output = "out"

    def perplexity(self, c: Candidate) -> float | None:
        return 50.0 if "runes" in c.text else 3.0


def run(budget, seed=0, min_speedup=None, noise=0.0):
    return floor_result(FakeDeployment(noise), budget, seed, NullProgress(), min_speedup,
                        {"seeds": SEEDS, "mode": "test"})


BUDGET = FloorBudget(seeds=6, candidates=20, max_new_tokens=32, population=4, confirm=2, repeats=4)


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b, c = run(BUDGET, seed=1), run(BUDGET, seed=1), run(BUDGET, seed=2)
    texts = lambda r: [d["text"] for d in r.details["candidates"]]
    assert texts(a) == texts(b)
    assert texts(a) != texts(c)
    assert len(texts(a)) == 6 + 20
    assert a.figures["budget"]["prompts_evaluated"] == 26
    assert a.figures["search"]["reproducible"] is True


def test_search_finds_lower_acceptance_and_confirms_the_floor():
    r = run(BUDGET, seed=3)
    cands = r.details["candidates"]
    suite_best_waste = max(d["waste_per_token"] for d in cands if not d["edits"])
    crafted_worst = max(d["waste_per_token"] for d in cands if d["edits"])
    assert crafted_worst > suite_best_waste  # the edits found prompts the drafter does worse on
    # the floor is a confirmed prompt's interval estimate, below what the suite alone gives
    assert r.figures["floor"] < 1.0 / (2.0 / (1 + 4 * 0.8)) - 1e-9
    assert r.figures["floor_prompt"].startswith("crafted-")
    assert r.figures["floor_ci_high"] >= r.figures["floor"] >= r.figures["floor_ci_low"]
    assert r.passed and r.informational  # no gate asked for


@pytest.mark.parametrize("seed", [4, 5, 10])
def test_degraded_outputs_are_neither_parents_nor_the_floor(seed):
    r = run(BUDGET, seed=seed)
    cands = {d["id"]: d for d in r.details["candidates"]}
    degraded = r.figures["quality"]["degraded"]
    assert degraded and all("runes" in cands[c]["text"] for c in degraded)  # these seeds do ask for runes
    for cid in r.details["confirmed"]:
        assert cands[cid]["quality"] == "intact"
    assert not any(cands[c]["parent"] in degraded for c in cands)
    assert r.figures["floor"] < 0.7  # the garbage did not take the search over


def test_gate_fails_only_when_the_whole_interval_is_below():
    slow = run(BUDGET, seed=3, min_speedup=1.2)  # the fake's floor is ~0.6x with no noise
    assert not slow.passed and slow.figures["below_min_speedup"]
    assert not slow.informational
    fine = run(BUDGET, seed=3, min_speedup=0.1)
    assert fine.passed and not fine.figures["below_min_speedup"]
    # noise so large the interval holds 1: no gate failure at 0.99 even where the estimate is below it
    noisy = run(FloorBudget(seeds=3, candidates=0, max_new_tokens=32, population=2, confirm=1, repeats=2),
                seed=0, min_speedup=0.99, noise=0.9)
    assert noisy.figures["floor_ci_high"] > 0.99 or noisy.figures["below_min_speedup"]
    assert noisy.passed == (not noisy.figures["below_min_speedup"])


@pytest.mark.parametrize("name", list(mutate.MUTATIONS))
def test_each_edit_changes_the_prompt_reproducibly(name):
    text = "Sort these items: apples, pears, plums, cherries.\nThen explain the sorting order."
    a = mutate.MUTATIONS[name](text, random.Random(7), [text, "Write a haiku about rain."])
    b = mutate.MUTATIONS[name](text, random.Random(7), [text, "Write a haiku about rain."])
    assert a == b and a != text


def test_trap_sets_up_a_match_and_asks_for_other_continuations():
    out = mutate.trap("Explain caching.", random.Random(1), [])
    first = out.split("copy this line exactly: ")[1].split("\n")[0]
    assert first in out and "different number" in out


def test_budget_refuses_what_cannot_give_an_interval():
    with pytest.raises(ValueError, match="repeats"):
        FloorBudget(seeds=1, candidates=0, max_new_tokens=8, population=1, confirm=1, repeats=1)
    with pytest.raises(ValueError, match="unknown mutation"):
        mutate.mutate("x", random.Random(0), [], ("nope",))


def test_the_engine_search_is_reproducible_and_reads_the_engines_record():
    """Offline on the tiny models: the guide is the engine's record at a fixed k (the
    adaptive policy's timing does not steer it), so the same seed evaluates the same prompts."""
    from tests.audit_tiny import one_thread, tiny_audit, tiny_models
    models = tiny_models()
    with one_thread():
        runs = [tiny_audit(models, drafter="draft-model", policy="adaptive", only=("speedup-floor",), seed=s)
                for s in (1, 1, 2)]
    floors = [next(c for c in r.checks if c.name == "speedup-floor") for r in runs]
    texts = [[d["text"] for d in f.details["candidates"]] for f in floors]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    f = floors[0]
    assert f.figures["search"]["reproducible"] and "fixed k=3" in f.figures["search"]["guide"]
    cands = f.details["candidates"]
    assert all(d["drafted"] and d["drafted"] >= d["accepted"] for d in cands)  # the draft model drafts every step
    assert f.figures["floor"] is not None and f.figures["floor_ci_low"] <= f.figures["floor"] <= f.figures["floor_ci_high"]
    assert all(d["perplexity"] and d["perplexity"] > 1 for d in cands)  # the target scored every output
