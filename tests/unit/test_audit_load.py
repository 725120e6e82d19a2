"""Load sweep helpers: the crossover rule and the phased policy."""

from verispec.audit.load import PhasedPolicy, crossover


def _pts(*speedups):
    return [{"batch": b, "speedup": s} for b, s in zip((1, 4, 16, 32), speedups)]


def test_crossover():
    assert crossover(_pts(1.4, 1.2, 0.9, 0.7)) == 16
    assert crossover(_pts(1.4, 1.2, 1.1, 1.05)) is None
    assert crossover(_pts(0.8, 0.7, 0.6, 0.5)) == 1  # never pays
    assert crossover(_pts(1.4, 0.9, 1.1, 0.8)) == 32  # the last size from which it stays below 1
    assert crossover(list(reversed(_pts(1.4, 1.2, 0.9, 0.7)))) == 16  # order does not matter


def test_phased_policy():
    from verispec.policy import FixedK

    class Recorder(FixedK):
        seen = 0

        def observe(self, requests, k, accepted):
            self.seen += 1
    inner = Recorder(4)
    p = PhasedPolicy(inner)
    assert p.max_k == 4 and p.choose([0, 0]) == [0, 0]
    p.observe([0, 0], [0, 0], [0, 0])
    assert inner.seen == 0  # plain phases are not the inner policy's business
    p.speculative = True
    assert p.choose([0, 0, 0]) == [4, 4, 4]
    p.observe([0], [4], [2])
    assert inner.seen == 1


def test_context_prompts_reach_the_length_and_end_with_a_task():
    from tests.audit_tiny import CharTokenizer, tiny_suite
    from verispec.audit.context import AuditConfig, AuditContext
    from verispec.audit.load import context_prompts
    from verispec.audit.progress import NullProgress

    tok, suite = CharTokenizer(), tiny_suite()
    ctx = AuditContext(AuditConfig(), None, tok, None, suite, suite, [], False, (), NullProgress())
    for n in (12, 60):
        prompts = context_prompts(ctx, 5, n)
        assert len(prompts) == 5 and len({tuple(p) for p in prompts}) == 5  # rows differ
        assert all(abs(len(p) - n) <= 2 for p in prompts), [len(p) for p in prompts]
        tasks = [tok(s.prompt)["input_ids"] for s in suite]
        assert all(any(p[-len(t):] == t for t in tasks) for p in prompts)  # a real task comes last
