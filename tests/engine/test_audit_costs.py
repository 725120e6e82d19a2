"""The audit's cost model: one, timed at the largest audited batch size and shared by every
adaptive engine of the audit (as a server's serves every load), read from the machine's
cost cache when asked (as generate and serve do), and recorded with where it came from."""

import dataclasses

import pytest

import verispec.audit.context as context_mod
from tests.audit_tiny import CharTokenizer, one_thread, tiny_drafter_factory, tiny_models, tiny_suite, TINY_SIZES
from verispec.audit.context import AuditConfig
from verispec.audit.runner import run_audit
from verispec.models import LoadedModel

SIZES = dataclasses.replace(TINY_SIZES, prompts_per_slice=1, max_new_tokens=8)


@pytest.fixture(scope="module")
def models():
    with one_thread():
        yield tiny_models()


def _audit(models, **kw):
    cfg = AuditConfig(target="tiny-llama", draft="tiny-draft-model", k=3, policy="adaptive",
                      batch_sizes=(1, 4, 8), sizes=SIZES, only=("equivalence",), **kw)
    with one_thread():
        return run_audit(cfg, target=LoadedModel(models[0], CharTokenizer(), None),
                         drafter_factory=tiny_drafter_factory(models), prompts=tiny_suite())


@pytest.fixture
def timed(monkeypatch):
    """measure_costs as the audit calls it, the batch sizes it was asked for recorded."""
    calls = []
    real = context_mod.measure_costs

    def spy(target, drafter, max_batch, max_k, **kw):
        calls.append(max_batch)
        return real(target, drafter, max_batch, max_k, repeats=1, **kw)
    monkeypatch.setattr(context_mod, "measure_costs", spy)
    return calls


def test_one_cost_model_at_the_largest_batch_serves_every_engine(models, timed, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    result = _audit(models)  # greedy runs at batch 1, 4 and 8 (and fixed k at 8)
    assert result.verdict == "pass", [c.summary for c in result.checks if not c.passed]
    assert timed == [8]
    cm = result.record["engine"]["cost_model"]
    assert cm["max_batch"] == 8 and cm["source"].startswith("measured by this audit")
    assert not (tmp_path / "costs").exists()  # cost_cache off (the default): nothing kept


def test_the_cost_cache_is_written_then_read(models, timed, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    first = _audit(models, cost_cache=True)
    assert timed == [8] and "written to the cost cache" in first.record["engine"]["cost_model"]["source"]
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    second = _audit(models, cost_cache=True)
    assert timed == [8]  # not timed again
    assert second.record["engine"]["cost_model"]["source"].startswith("read from the cost cache")
    assert second.verdict == "pass"


def test_an_audit_with_an_injected_fault_leaves_the_cache_alone(models, timed, monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    _audit(models, cost_cache=True, inject_fault="row-leak")
    assert timed == [8] and not (tmp_path / "costs").exists()
