"""The engine step's seams as one object, passed to `Engine(..., hooks=...)`.

StepHooks' methods are the correct behaviour, and the engine binds them once when it is
built, so a step pays nothing for them. A test or the audit's fault suite
(audit/faults/) passes a subclass that breaks one seam on purpose, for that engine
alone: nothing else in the process changes. The drafter's seams are in
drafters/base.py (DrafterHooks), the native model's RoPE positions in models/llama.py
(LlamaModel.with_positions).
"""

from __future__ import annotations

import torch

from ..sampling import keyed_gumbel, logits_to_probs
from ..verify import verify
from ..verify import tree as draft_tree
from .request import Request


class StepHooks:
    """The seams of one engine's step. The engine calls each through the hooks it was
    built with: this class's when it was given none."""

    def draft_budget(self, r: Request) -> int:
        """The most drafts row r may verify: a step emits at most k + 1 tokens."""
        return r.params.max_new_tokens - len(r.output_ids) - 1

    def pending_tokens(self, reqs: list[Request], step: int) -> torch.Tensor:
        """Each row's pending token, the first column of the verify pass [B,1]; step: the
        engine's count of finished steps."""
        return torch.tensor([[r.tokens[-1]] for r in reqs])

    def append(self, r: Request, emitted: list[int]) -> str | None:
        """Append a step's emitted tokens up to the first stop token or the length limit,
        wherever it falls in the accepted run; -> "stop", "length" or None."""
        for tok in emitted:
            r.output_ids.append(tok)
            if not r.params.ignore_eos and tok in r.params.stop_token_ids:
                return "stop"
            if len(r.output_ids) >= r.params.max_new_tokens:
                return "length"
        return None

    def committed_length(self, r: Request) -> int:
        """The tokens of r its cache rows keep after the commit: all but the new pending one."""
        return len(r.tokens) - 1

    # the sampling distribution p [1,K+1,V] of a sampled row's verify pass
    verify_probs = staticmethod(logits_to_probs)
    # the noise keyed on (seed, sequence index) that a seeded (coupled) row is verified with
    keyed_noise = staticmethod(keyed_gumbel)
    # verification: verify(rule, p, q, drafts, num, generator), dispatching on the rule's name
    verify = staticmethod(verify)
    # a draft tree's verify pass: (depth [B,T], visible [B,T,T]) from each row's node parents
    tree_layout = staticmethod(draft_tree.layout)
    # a draft tree's verdict: walk(parents, tokens, draw) -> TreeWalk (slots kept, tokens emitted)
    tree_walk = staticmethod(draft_tree.walk)


CORRECT = StepHooks()  # holds no state: every engine built without hooks shares it
