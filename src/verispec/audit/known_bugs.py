"""The catalogue of real speculative-decoding bugs that changed what users received, each
tied to the audit check meant to catch it and, where one exists, to its re-creation on a
server that runs here (tests/vllm_patches/: a named patch applied to vLLM with
VERISPEC_VLLM_BUGS). A FAIL quotes an entry's signature so a reader recognises a known
failure by what it looks like from outside.

Every entry is a public issue or pull request read in its project's tracker; its title is
the thread's own. Several bugs share one re-creation: a bug in SGLang, TensorRT-LLM or
transformers is re-created as the analogue of its class in vLLM, and recreated_as says so.
A bug that needs what this deployment cannot run (tensor parallelism, a hybrid model, a
vocabulary-scale batch) is cited only, and not_recreated says why.

Check names are never spelled here: each entry holds its Check object from the registry,
so the catalogue follows a rename (tests/unit/test_audit_structure.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from . import checks
from .checks import Check
from .registry import (ACCEPTANCE, CORRUPTION, COUNTERS, DISTRIBUTION, LOGPROBS, SAMPLING_PARAMS, SEEDED,
                       STOPPING)

CLASSES = ("sampling-parameters", "logprob-values", "speculative-counters", "stop-handling", "seeding",
           "acceptance-rule", "uninitialised-buffer", "ragged-cache", "residual-distribution")
SERVERS = ("vllm", "llama.cpp", "sglang", "tgi", "tensorrt-llm", "transformers")
# the patches tests/vllm_patches/ apply by these names; some have no real report behind them
# yet (temperature-twice, logprobs-shifted, max-tokens-overrun, counters-rejected-as-accepted)
# and are kept as the classes
# the audit must still fail
RECREATIONS = ("uninitialised-temperature", "relaxed-acceptance", "target-temperature-skipped",
               "bonus-only-filters", "penalties-skipped", "temperature-twice", "logprobs-placeholder",
               "logprobs-shifted", "counters-after-eos", "stop-leak", "max-tokens-overrun", "seed-ignored",
               "seed-misindexed", "recovered-from-target", "greedy-verify-sampled",
               "counters-rejected-as-accepted")
CITE = re.compile(r"^[\w.-]+/[\w.-]+#\d+$")

# what each class looks like in a FAIL, shared by the entries of that class where the words fit
_TARGET_FILTER = ("drafted positions emit tokens the target finds far less likely than it should: a temperature "
                  "or filter not applied at verification")
_BONUS_ONLY = ("a filter the request set (min_p, logit_bias, a grammar) holds at bonus positions but not at "
               "verified drafted positions: tokens it forbids or disfavours appear only inside accepted runs")
_PENALTY = ("tokens the request penalised keep their unpenalised probability at drafted positions: a penalty "
            "that acts without speculation does not act with it")
_LOGPROB_FILLER = ("returned logprobs of drafted tokens are 0 (p = 1) or empty, while the target scores the same "
                   "tokens far lower: a placeholder, not the target's probability")
_COUNTER_OVER = ("the server's speculative counters disagree with the tokens it emitted: drafts that never "
                 "reached the output are counted")
_STOP_LEAK = ("output runs past a stop token or stop string that fell inside an accepted run, and finishes with "
              "reason length instead of stop")
_SEED_IGNORED = ("two requests with the same seed return different text with speculation on, and the same text "
                 "with it off")
_SEED_ROWS = ("a seeded or sampled request's text depends on the requests batched with it: rows draw from each "
              "other's random streams")
_GARBAGE_SCALE = ("sampled tokens at drafted positions follow no temperature the request set: infinite or garbage "
                  "scaling shows as tokens the target finds nearly impossible, or as runs of one token")
_OVER_ACCEPT = ("drafted tokens are emitted more often than min(1, p/q) allows: acceptance sits above what the "
                "target's own probabilities support, and the output leans toward what the drafter proposes")
_GREEDY_SAMPLED = ("requests at temperature > 0 come back as the target's greedy text: every draw the same, "
                   "the sampled distribution collapsed onto its argmax")
_RESIDUAL = ("tokens emitted after a rejected draft do not follow the residual max(0, p - q): the rejected "
             "draft's probability mass is missing, doubled or taken from the wrong distribution")
_RAGGED = ("with speculation on and several requests in flight, outputs loop, stutter or drift into text the "
           "target finds improbable, where the plain reference does not")


@dataclass(frozen=True)
class KnownBug:
    """One real bug. cite: owner/repo#N of the thread; title: that thread's title as found;
    effect: what it did to the output; signature: what a FAIL shows from outside; check: the
    registered Check meant to catch it; recreated: the name of its re-creation here
    (RECREATIONS), with recreated_as saying how it maps, or None with not_recreated saying why."""

    slug: str
    cite: str
    title: str
    server: str
    bug_class: str
    effect: str
    signature: str
    check: Check
    recreated: str | None
    recreated_as: str = ""
    not_recreated: str = ""


CATALOGUE: tuple[KnownBug, ...] = (
    # -- sampling parameters the verifier did not apply ---------------------------------------
    KnownBug(
        slug="vllm-target-params-skipped", cite="vllm-project/vllm#10198",
        title="[Bugfix][SpecDecode] apply sampling parameters to target probabilities for consistency in "
              "rejection sampling.",
        server="vllm", bug_class="sampling-parameters",
        effect="The rejection sampler compared drafts against target probabilities without the request's "
               "temperature, top-p and penalties, so accepted tokens followed the raw target distribution.",
        signature=_TARGET_FILTER, check=SAMPLING_PARAMS, recreated="target-temperature-skipped",
        recreated_as="the same bug: verification reads the target's probabilities before the request's "
                     "temperature is applied"),
    KnownBug(
        slug="vllm-min-p-logit-bias-bonus-only", cite="vllm-project/vllm#42744",
        title="[Bug]: rejection sampler skips argmax-invariant procs — patching the min_p/logit_bias 400 alone "
              "is insufficient",
        server="vllm", bug_class="sampling-parameters",
        effect="min_p and logit_bias reach the bonus token through the plain sampler but not the verified "
               "drafted positions, so one response honours them at some positions only.",
        signature=_BONUS_ONLY, check=SAMPLING_PARAMS, recreated="bonus-only-filters",
        recreated_as="the same bug: argmax-invariant logits processors skipped in the rejection sampler"),
    KnownBug(
        slug="sglang-logit-bias-eagle-verify", cite="sgl-project/sglang#11555",
        title="make sure logit bias is applied during eagle spec decoding verification",
        server="sglang", bug_class="sampling-parameters",
        effect="With EAGLE speculation on, SGLang's verify step ignored the request's logit_bias.",
        signature=_BONUS_ONLY, check=SAMPLING_PARAMS, recreated="bonus-only-filters",
        recreated_as="an SGLang bug, re-created as its analogue in vLLM: a logits processor skipped at the "
                     "verified positions"),
    KnownBug(
        slug="vllm-grammar-after-reasoning", cite="vllm-project/vllm#36138",
        title="[Bugfix] Grammar was ignored when reasoning ended within speculated tokens",
        server="vllm", bug_class="sampling-parameters",
        effect="When the end of reasoning fell inside a speculated run, the drafts after it were not checked "
               "against the structured-output grammar, and the final answer broke its schema.",
        signature=_BONUS_ONLY, check=SAMPLING_PARAMS, recreated="bonus-only-filters",
        recreated_as="its analogue: a mask that holds outside accepted runs and is skipped inside them"),
    KnownBug(
        slug="vllm-frequency-penalty-ignored", cite="vllm-project/vllm#18902",
        title="[Bug]: The frequency penalty does not work when spec decoding is enabled in V1, with no warning "
              "or error",
        server="vllm", bug_class="sampling-parameters",
        effect="With EAGLE speculation on in V1, frequency_penalty had no effect on the output, and nothing warned "
               "that it was dropped.",
        signature=_PENALTY, check=SAMPLING_PARAMS, recreated="penalties-skipped",
        recreated_as="the same bug: penalties not applied to the logits the rejection sampler verifies"),
    KnownBug(
        slug="trtllm-penalties-ignored", cite="NVIDIA/TensorRT-LLM#17701",
        title="[TRTLLM-15406][feat] Support occurrence penalties in one-model speculative decoding",
        server="tensorrt-llm", bug_class="sampling-parameters",
        effect="One-model speculative decoding (MTP, EAGLE-3 one-model, draft-target) silently ignored "
               "repetition, presence and frequency penalties and decoded from the unpenalised distribution.",
        signature=_PENALTY, check=SAMPLING_PARAMS, recreated="penalties-skipped",
        recreated_as="a TensorRT-LLM bug, re-created as its analogue in vLLM's rejection sampler"),
    KnownBug(
        slug="sglang-penalties-per-step", cite="sgl-project/sglang#33643",
        title="[Bug] Accumulate sampling penalties per accepted token under speculative decoding",
        server="sglang", bug_class="sampling-parameters",
        effect="Only the last token of each accepted run entered the penalty state, so frequency_penalty acted "
               "at about 1/L of its strength and min_new_tokens counted steps instead of tokens.",
        signature=_PENALTY, check=SAMPLING_PARAMS, recreated="penalties-skipped",
        recreated_as="an SGLang bug, re-created as its analogue: penalties that miss the accepted drafts"),
    KnownBug(
        slug="vllm-greedy-temperature-sentinel", cite="vllm-project/vllm#27077",
        title="[V1][Spec Decode] Fix greedy temperature detection after sampler refactor",
        server="vllm", bug_class="sampling-parameters",
        effect="After greedy rows changed their temperature from -1 to 0, the rejection sampler still looked "
               "for -1 and divided greedy rows' logits by zero: NaN logits, empty outputs, negative acceptance.",
        signature=_GARBAGE_SCALE, check=DISTRIBUTION, recreated="uninitialised-temperature",
        recreated_as="its analogue: a per-token temperature at drafted positions that is not the request's "
                     "(zero there, garbage in the re-creation), dividing logits into inf"),
    # -- buffers the verifier read without writing them --------------------------------------
    KnownBug(
        slug="vllm-cpu-uninitialised-temperature", cite="vllm-project/vllm#55005",
        title="[Bug][CPU][Spec Decode]: CPU expand_kernel shim discards its output — non-greedy spec decode "
              "consumes uninitialized memory as temperature/top_k/top_p",
        server="vllm", bug_class="uninitialised-buffer",
        effect="On CPU builds the expand shim filled a temporary, so the rejection sampler scaled and filtered "
               "drafted positions with uninitialised memory as temperature, top_k and top_p.",
        signature=_GARBAGE_SCALE, check=DISTRIBUTION, recreated="uninitialised-temperature",
        recreated_as="the same bug: vLLM 0.32.0 on CPU without the fix"),
    KnownBug(
        slug="vllm-cpu-expand-noop", cite="vllm-project/vllm#42638",
        title="[Bugfix][Spec Decode][CPU] Fix expand_batch_to_tokens on CPU",
        server="vllm", bug_class="uninitialised-buffer",
        effect="On CPU the Triton expand kernel returned without running, leaving new_empty memory as the "
               "per-token sampling parameters: garbage scaling, or an out-of-bounds crash on the first sampled "
               "request.",
        signature=_GARBAGE_SCALE, check=DISTRIBUTION, recreated="uninitialised-temperature",
        recreated_as="the earlier form of the same bug: the expand step leaves its output unwritten"),
    KnownBug(
        slug="vllm-int32-offset-overflow", cite="vllm-project/vllm#48055",
        title="[Bugfix] Fix int32 offset overflow in rejection sampler kernels",
        server="vllm", bug_class="uninitialised-buffer",
        effect="Row times vocabulary offsets wrapped past 2**31 in large speculative batches, so late rows read "
               "other memory as their probabilities: corrupted accept decisions and recovered tokens.",
        signature=_RESIDUAL, check=DISTRIBUTION, recreated=None,
        not_recreated="it needs about 8,500 verified rows of a 250k vocabulary in one step, far beyond a CPU "
                      "deployment's batch"),
    # -- the acceptance rule -------------------------------------------------------------------
    KnownBug(
        slug="vllm-typical-acceptance-lossy", cite="vllm-project/vllm#5131",
        title="[Speculative Decoding 1/2 ] Add typical acceptance sampling as one of the sampling techniques in "
              "the verifier",
        server="vllm", bug_class="acceptance-rule",
        effect="A lossy rule by design, behind an option: Medusa's typical acceptance accepts any draft the "
               "target finds plausible against its entropy, trading the target distribution for acceptance.",
        signature=_OVER_ACCEPT, check=ACCEPTANCE, recreated="relaxed-acceptance",
        recreated_as="its class: an acceptance test looser than min(1, p/q)"),
    KnownBug(
        slug="transformers-always-accept", cite="huggingface/transformers#28508",
        title="Fix `_speculative_sampling` implementation",
        server="transformers", bug_class="acceptance-rule",
        effect="A faulty count of matches made assisted generation with sampling accept the draft model's "
               "tokens every time.",
        signature=_OVER_ACCEPT, check=ACCEPTANCE, recreated="relaxed-acceptance",
        recreated_as="a transformers bug, re-created as its analogue: vLLM's acceptance test relaxed"),
    KnownBug(
        slug="transformers-greedy-assistant-q", cite="huggingface/transformers#32867",
        title="Speculative sampling does not maintain probability distribution of main model",
        server="transformers", bug_class="acceptance-rule",
        effect="The assistant drafted greedily while the acceptance ratio used its softmax q, so drafts were "
               "accepted as if they had been sampled and the output leaned toward the assistant's argmax.",
        signature=_OVER_ACCEPT, check=ACCEPTANCE, recreated="relaxed-acceptance",
        recreated_as="a transformers bug, re-created as its analogue: drafts accepted more often than p/q "
                     "with their true q allows"),
    KnownBug(
        slug="transformers-q-not-sampled-from", cite="huggingface/transformers#47932",
        title="Speculative decoding: candidate generators return a `q` they did not sample from, breaking "
              "losslessness with `do_sample=True`",
        server="transformers", bug_class="acceptance-rule",
        effect="DFlash, MTP and multi-token candidate generators returned raw logits as q while drafting from "
               "processed ones, inflating every acceptance ratio by 1/Z and building the residual from mass "
               "the drafter never proposes.",
        signature=_OVER_ACCEPT, check=ACCEPTANCE, recreated="relaxed-acceptance",
        recreated_as="a transformers bug, re-created as its analogue: an acceptance ratio inflated above p/q"),
    KnownBug(
        slug="sglang-hip-greedy-verify", cite="sgl-project/sglang#39253",
        title="[AMD][SPEC]Fix DeepSeek-V4 benchmark accuracy gap by supporting temperature sampling in EAGLE "
              "verify",
        server="sglang", bug_class="acceptance-rule",
        effect="On ROCm every EAGLE verify took the argmax branch whatever the requested temperature, so "
               "sampled requests decoded greedily and fell into repetition loops.",
        signature=_GREEDY_SAMPLED, check=DISTRIBUTION, recreated="greedy-verify-sampled",
        recreated_as="an SGLang bug, re-created as its analogue: vLLM's greedy verification taken for sampled "
                     "requests"),
    # -- the residual a rejection samples from --------------------------------------------------
    KnownBug(
        slug="vllm-ascend-target-probs-corrupted", cite="vllm-project/vllm-ascend#2881",
        title="Fix: Prevent permanent corruption of target_probs in N-gram sampler",
        server="vllm", bug_class="residual-distribution",
        effect="vLLM's Ascend plugin zeroed the draft token in target_probs in place before cloning them for "
               "recovery, so sampled n-gram requests drew from an altered target distribution.",
        signature=_RESIDUAL, check=DISTRIBUTION, recreated="recovered-from-target",
        recreated_as="its analogue: the recovered token drawn from a distribution other than the residual"),
    # -- logprobs --------------------------------------------------------------------------------
    KnownBug(
        slug="llamacpp-logprob-placeholder", cite="ggml-org/llama.cpp#27972",
        title="Eval bug: llama-server returns logprob 0.0 (p=1.0) for every token when speculative decoding is "
              "enabled",
        server="llama.cpp", bug_class="logprob-values",
        effect="With speculation on, llama-server returned logprob 0.0 (p = 1.0) for every token: a placeholder "
               "probability for accepted tokens that is never replaced by the target's.",
        signature=_LOGPROB_FILLER, check=LOGPROBS, recreated="logprobs-placeholder",
        recreated_as="a llama.cpp bug, re-created as its analogue in vLLM's logprobs of drafted positions"),
    KnownBug(
        slug="vllm-ngram-logprobs-zero", cite="vllm-project/vllm#17876",
        title="[Bug]: Speculative decode ngram ，logprobs is 0.0",
        server="vllm", bug_class="logprob-values",
        effect="With n-gram speculation in vLLM 0.7.3 the requested logprobs came back as 0.0 or empty.",
        signature=_LOGPROB_FILLER, check=LOGPROBS, recreated="logprobs-placeholder",
        recreated_as="the same class: a filler value where the target's logprob belongs"),
    KnownBug(
        slug="vllm-mtp-logprobs-stale-drafts", cite="vllm-project/vllm#38711",
        title="Fix invalid logprobs with MTP enabled and sync scheduling",
        server="vllm", bug_class="logprob-values",
        effect="Near max_model_len the drafter was skipped but its stale drafts were kept under sync "
               "scheduling, corrupting Mamba state and returning catastrophically wrong logprobs.",
        signature=("logprobs far from the target's own score of the same tokens, appearing only as requests "
                   "approach the context limit"),
        check=LOGPROBS, recreated=None,
        not_recreated="it needs a hybrid Mamba model with MTP drafting, which this deployment does not serve"),
    # -- counters ----------------------------------------------------------------------------------
    KnownBug(
        slug="vllm-acceptance-length-after-eos", cite="vllm-project/vllm#56101",
        title="[Bug]: [Spec Decode Metrics] mean_acceptance_length overcounts tokens when EOS occurs inside the "
              "accepted draft prefix",
        server="vllm", bug_class="speculative-counters",
        effect="Drafts accepted after an EOS inside the accepted run were counted though never emitted, so the "
               "reported acceptance length exceeded the tokens a step committed.",
        signature=_COUNTER_OVER, check=COUNTERS, recreated="counters-after-eos",
        recreated_as="the same bug: accepted drafts past the stop counted in the spec-decode counters"),
    KnownBug(
        slug="sglang-counts-past-eos", cite="sgl-project/sglang#39826",
        title="[Bug] Speculative decoding counts reasoning tokens past EOS, exceeding completion_tokens",
        server="sglang", bug_class="speculative-counters",
        effect="Tokens accepted past EOS were counted as reasoning tokens, so the usage reported more of them "
               "than completion_tokens.",
        signature=_COUNTER_OVER, check=COUNTERS, recreated="counters-after-eos",
        recreated_as="an SGLang bug, re-created as its analogue in vLLM's counters"),
    KnownBug(
        slug="llamacpp-draft-rate-counts-skipped", cite="ggml-org/llama.cpp#14104",
        title="server: Fixed speculative decoding stats to use `#accepted \\ #tested` rather than "
              "`#accepted \\ #drafted`",
        server="llama.cpp", bug_class="speculative-counters",
        effect="Drafts dropped by --draft-min were counted as drafted, so llama-server's draft acceptance rate "
               "read lower than the rate of the drafts it tested (ggml-org/llama.cpp#14048).",
        signature=_COUNTER_OVER, check=COUNTERS, recreated=None,
        not_recreated="llama.cpp's --draft-min has no counterpart in vLLM; the audit reads llama-server's own "
                      "timings for it"),
    KnownBug(
        slug="llamacpp-stats-on-restore", cite="ggml-org/llama.cpp#25682",
        title="server: draft acceptance stats were wrong whenever the target could n…",
        server="llama.cpp", bug_class="speculative-counters",
        effect="Where the target cache cannot roll back, partial acceptances were counted as zero and their "
               "replays as perfect drafts, distorting the acceptance rate and per-position figures.",
        signature=_COUNTER_OVER, check=COUNTERS, recreated=None,
        not_recreated="it needs a target whose cache restores from checkpoints (sliding-window or recurrent), "
                      "a llama.cpp path vLLM does not take"),
    # -- stops -----------------------------------------------------------------------------------
    KnownBug(
        slug="sglang-stop-masked-by-cap", cite="sgl-project/sglang#31599",
        title="Speculative decode: max_new_tokens cap masks an in-budget stop string and leaks post-stop tokens",
        server="sglang", bug_class="stop-handling",
        effect="max_new_tokens was checked before the stops, so an accepted run that crossed the cap finished "
               "as length and emitted the tokens after an EOS or stop inside it, bonus token included.",
        signature=_STOP_LEAK, check=STOPPING, recreated="stop-leak",
        recreated_as="an SGLang bug, re-created as its analogue in vLLM's output processor"),
    KnownBug(
        slug="sglang-stop-string-window", cite="sgl-project/sglang#23802",
        title="fix: stop-string check misses early matches during speculative decoding",
        server="sglang", bug_class="stop-handling",
        effect="The stop-string check decoded only a tail window, so a stop string early in a long accepted run "
               "was missed and generation went on past it.",
        signature=_STOP_LEAK, check=STOPPING, recreated="stop-leak",
        recreated_as="an SGLang bug, re-created as its analogue in vLLM's output processor"),
    # -- seeds -----------------------------------------------------------------------------------
    KnownBug(
        slug="vllm-seed-ignored", cite="vllm-project/vllm#6038",
        title="[Bug]: Speculative decoding does not respect per-request seed",
        server="vllm", bug_class="seeding",
        effect="With speculation on, a request's seed did not reach the rejection sampler, so seeded requests "
               "returned different text every time.",
        signature=_SEED_IGNORED, check=SEEDED, recreated="seed-ignored",
        recreated_as="the same bug: the request's seed not reaching the speculative sampler's draws"),
    KnownBug(
        slug="trtllm-seed-ignored", cite="NVIDIA/TensorRT-LLM#17599",
        title="[None][feat] Honor SamplingParams.seed on the one-model speculative path",
        server="tensorrt-llm", bug_class="seeding",
        effect="One-model speculative sampling used one engine-wide seed, so SamplingParams.seed was ignored and "
               "output depended on how many steps the engine had taken.",
        signature=_SEED_IGNORED, check=SEEDED, recreated="seed-ignored",
        recreated_as="a TensorRT-LLM bug, re-created as its analogue in vLLM's rejection sampler"),
    KnownBug(
        slug="vllm-seed-none-in-batch", cite="vllm-project/vllm#10863",
        title="[Bugfix] Fix spec decoding when seed is none in a batch",
        server="vllm", bug_class="seeding",
        effect="In a batch mixing seeded and unseeded requests, the rejection sampler's multinomial indexed the "
               "wrong rows, and a request expected to write 'I will never miss any tokens.' wrote "
               "'I!!!!!!!! will'.",
        signature=_SEED_ROWS, check=SEEDED, recreated="seed-misindexed",
        recreated_as="the same bug: per-request generators applied to the wrong rows"),
    KnownBug(
        slug="vllm-parallel-seeds-gibberish", cite="vllm-project/vllm#9441",
        title="[Bug]: Speculative decoding generate gibberish when receiving parallel requests with different "
              "seeds",
        server="vllm", bug_class="seeding",
        effect="Parallel requests with different seeds turned a repeat-the-phrase prompt into gibberish under "
               "speculation, even at temperature 0.",
        signature=_RAGGED, check=CORRUPTION, recreated="seed-misindexed",
        recreated_as="the same class: random streams crossed between batched rows"),
    KnownBug(
        slug="vllm-tp-ranks-accept-differently", cite="vllm-project/vllm#17498",
        title="[Bug]: [V1][Spec Dec] Rejection sampler accepts different tokens when TP > 1 and Temp > 0",
        server="vllm", bug_class="seeding",
        effect="At temperature > 0 with tensor parallelism, the rejection samplers of the ranks accepted "
               "different tokens for the same request.",
        signature=("sampled output that is incoherent or off the target's distribution with tensor parallelism, "
                   "and sound on one rank"),
        check=CORRUPTION, recreated=None,
        not_recreated="it needs tensor parallelism across ranks; the CPU deployment here runs one"),
    KnownBug(
        slug="trtllm-shared-rng-stream", cite="NVIDIA/TensorRT-LLM#19487",
        title="[Bug]: Speculative decoding + TorchSampler: unseeded requests share one RNG stream → "
              "identical/degenerate samples at low concurrency",
        server="tensorrt-llm", bug_class="seeding",
        effect="Unseeded requests under speculation shared one RNG stream, so independent requests drew "
               "identical or degenerate samples at low concurrency.",
        signature=("independent unseeded requests at temperature > 0 return the same text, or samples that "
                   "repeat across requests far more often than the target's distribution allows"),
        check=DISTRIBUTION, recreated="seed-misindexed",
        recreated_as="a TensorRT-LLM bug, re-created as its analogue: rows drawing from a stream not their own"),
    # -- ragged batches and caches ---------------------------------------------------------------
    KnownBug(
        slug="vllm-gdn-ngram-state", cite="vllm-project/vllm#39273",
        title="[Bug]: Ngram speculative decoding produces corrupted output on hybrid GDN (Qwen3.5) models",
        server="vllm", bug_class="ragged-cache",
        effect="After accepted n-gram drafts on hybrid GatedDeltaNet models, the next step read its recurrent "
               "state from the wrong block and the output corrupted, even greedy.",
        signature=_RAGGED, check=CORRUPTION, recreated=None,
        not_recreated="it needs a hybrid linear-attention model; the deployment here serves plain attention"),
    KnownBug(
        slug="tgi-medusa-batch-corruption", cite="huggingface/text-generation-inference#1411",
        title="V1.3.4 There is a bug in the medusa speculate decoding ，Occasional bug",
        server="tgi", bug_class="ragged-cache",
        effect="With Medusa and flash attention together, one request of a large batch turned into strange "
               "tokens mid-output while batch size 1 stayed clean.",
        signature=_RAGGED, check=CORRUPTION, recreated=None,
        not_recreated="a TGI Medusa kernel path; vLLM on CPU has no Medusa heads to re-create it with"),
    KnownBug(
        slug="tgi-ngram-nonsense", cite="huggingface/text-generation-inference#2997",
        title="Nonsense responses with n-gram speculative decoding",
        server="tgi", bug_class="ragged-cache",
        effect="TGI 3.0 and 3.1 with --speculate 2 (n-gram) answered Llama-3.1-8B requests with nonsense.",
        signature=_RAGGED, check=CORRUPTION, recreated=None,
        not_recreated="the thread names no cause to re-create; the corruption check catches its signature on "
                      "TGI itself"),
)


def validate(entries) -> None:
    """Refuse a catalogue that could mislead: a malformed or repeated cite, a repeated slug, an
    unknown server, class or re-creation, an entry re-created and excused at once (or
    neither), or a check that is not the registered one of its name."""
    slugs, cites = set(), set()
    for e in entries:
        if not CITE.match(e.cite):
            raise ValueError(f"{e.slug}: cite {e.cite!r} is not owner/repo#N")
        if e.slug in slugs or e.cite in cites:
            raise ValueError(f"{e.slug}: slug or cite {e.cite} appears twice")
        slugs.add(e.slug)
        cites.add(e.cite)
        if e.server not in SERVERS or e.bug_class not in CLASSES:
            raise ValueError(f"{e.slug}: unknown server {e.server!r} or class {e.bug_class!r}")
        if not isinstance(e.check, Check) or checks.find(e.check.name) is not e.check:
            raise ValueError(f"{e.slug}: its check is not a registered Check")
        if e.recreated is not None and e.recreated not in RECREATIONS:
            raise ValueError(f"{e.slug}: unknown re-creation {e.recreated!r}")
        if (e.recreated is None) == (not e.not_recreated) or (e.recreated is not None) == (not e.recreated_as):
            raise ValueError(f"{e.slug}: say how it is re-created (recreated_as) or why not (not_recreated)")
        if not (e.title and e.effect and e.signature):
            raise ValueError(f"{e.slug}: title, effect and signature are all needed")


def by_check(check: Check) -> list[KnownBug]:
    return [e for e in CATALOGUE if e.check is check]


def by_recreation(name: str) -> list[KnownBug]:
    return [e for e in CATALOGUE if e.recreated == name]


def recreations() -> tuple[str, ...]:
    """Every re-creation name the vLLM patches answer to, including those no cited bug maps to."""
    return RECREATIONS


validate(CATALOGUE)
