"""Drafters propose tokens; the policy (policy/) decides how many.

Drafter protocol (all row arguments are KV-cache rows of the engine's target cache)::

    name: str
    admit(rows, tokens)                 new requests joined on these rows
    admit_scopes(rows, scopes)          (optional) right after admit: each request's scope
    learn(rows, tokens)                 (optional) the requests finished with these sequences
    prepare(rows, tokens)               these rows draft in this step, for the first time or
        again: work a drafter deferred until a row drafts (the draft model's prefill) is
        done here, and the engine counts it as prefill, not as drafting. A row the policy
        never lets draft costs such a drafter nothing.
    propose(rows, tokens, k, sampling, generators[, halt])
        -> draft_tokens [B,K] long, draft_probs [B,K,V] | None, num_drafts [B] long
        tokens[b] is the row's whole sequence so far; its last token is the pending
        one (not yet in the target's cache). k[b] drafts for row b (0 allowed).
        num_drafts[b] <= k[b]: a drafter may find fewer (prompt lookup without a match).
        draft_probs None means the drafter has no distribution (q is one-hot).
    halts: bool                         (optional) propose takes `halt`: after drafting
        position i for the rows `active` (indices into rows), it calls
        halt(i, active, conf) -> list[bool], conf[j] being the drafter's own probability
        of the token it drafted for row active[j]; rows answered True stop at i + 1
        drafts. Only the drafter's probabilities reach the rule, never the target's
        verdicts, so a policy deciding there stays non-anticipating.
    found_conf: list | None             (optional) after propose: per row, the drafter's own
        estimate of P(draft i accepted | drafts before it were) for each draft found (a
        model-free drafter's counts); None where it has none. The policy's trim() reads it
        (through a calibration it learns), never the target's verdicts.
    rollback(rows, committed)           the target kept committed[b] tokens in cache
    replayable: bool, replica()         (optional) drafts are a function of the request's own
        prefix: replica() is a fresh drafter with the same settings that the audit replays
        each request on (suffix decoding without its global cache; base.py)
    release(rows)                       the rows' requests left the batch
    hooks: DrafterHooks | None          (optional) seams a test breaks on purpose (base.py)
"""

from __future__ import annotations

from .base import Drafter, DrafterHooks, apply_halt, draft_from_logits

__all__ = ["Drafter", "DrafterHooks", "apply_halt", "draft_from_logits", "make_drafter", "loads_no_model"]

def loads_no_model(spec: str) -> bool:
    """Whether make_drafter builds this spec without loading a draft model: 'lookup[:N]',
    'suffix[:options]', 'layerskip:N' (the target's own layers)."""
    kind, colon, _ = spec.partition(":")
    return kind in ("lookup", "suffix") or (kind == "layerskip" and bool(colon))


def make_drafter(spec: str | None, target, target_tokenizer, *, max_rows: int, max_len: int,
                 progress: bool = True):
    """Build a drafter from a CLI/server spec: None|'none', 'lookup[:N]', 'suffix[:options]'
    (drafters/suffix.py: depth=, factor=, offset=, min-prob=, cache=), 'layerskip:N',
    or a model (preset name, directory, GGUF file, hub id), loaded on the target's backend."""
    if spec is None or spec == "none":
        return None
    if spec == "lookup" or spec.startswith("lookup:"):
        from .lookup import PromptLookupDrafter
        n = int(spec.split(":", 1)[1]) if ":" in spec else 3
        return PromptLookupDrafter(max_ngram=n)
    if spec == "suffix" or spec.startswith("suffix:"):
        from .suffix import SuffixDrafter, SuffixSettings
        return SuffixDrafter(SuffixSettings.parse(spec.partition(":")[2]))
    if spec.startswith("layerskip:"):
        from .layerskip import LayerSkipDrafter
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"layerskip:N needs an integer layer count, got {spec!r}") from None
        return LayerSkipDrafter(target, n)
    from ..models import load_model
    from .draft_model import DraftModelDrafter
    loaded = load_model(spec, progress=progress, backend=target.runtime)
    return DraftModelDrafter(loaded.model, target.config.vocab_size, max_rows=max_rows,
                             max_len=max_len, draft_tokenizer=loaded.tokenizer,
                             target_tokenizer=target_tokenizer, name=spec)
