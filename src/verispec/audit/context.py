"""The audit's configuration (frozen, built at the edge) and the context every check reads:
the target, a drafter factory, the encoded prompts and the greedy runs they share."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import Engine, EngineConfig, GenerationParams, Request
from ..policy import FixedK
from ..policy.adaptive import AdaptivePolicy
from ..policy.costs import CostCache, measure_costs
from ..sampling import SamplingParams
from ..verify import RULES
from .checks import ENGINE, selectable
from .floor import FloorBudget
from .suite import SuitePrompt, slices

DrafterFactory = Callable[[int, int], Any]  # (max_rows, max_len) -> a Drafter (see drafters/)


@dataclass(frozen=True)
class AuditSizes:
    """How much work each check does. `quick()` takes ~3.3 minutes of SmolLM2-135M on 2 CPU
    cores (199 s measured quiet; 243 s with 32 greedy tokens and no prefill reuse), `full()`
    ~19 (1,145 s before the prefill reuse); tests build tiny ones."""

    name: str
    prompts_per_slice: int | None  # None: every prompt of the suite
    max_new_tokens: int  # greedy runs (equivalence, consistency, corruption, slices)
    distribution_tokens: int  # at least this many sampled tokens go into the PIT test
    distribution_max_new: int  # tokens per sampled request (fixed length: EOS ignored)
    seeded_prompts: int | None  # prompts of the seeded check (None: every audited prompt)
    seeded_max_new: int  # tokens per seeded request
    short_context: int  # load sweep prompt lengths, in tokens
    long_context: int
    long_max_batch: int | None  # long context only at batch sizes <= this (None: all)
    load_rounds: int  # plain/speculative alternations per load point (ABBA order)
    load_steps: int  # engine steps per phase per round
    # the distribution check's calibration probe (audit/probe.py): at least this many tokens
    # sampled with the target drafting for itself from a nucleus of its own p, at these
    # masses (requests take them in turn); the probe's power is greatest against a relaxed
    # threshold min(1, c p/q) at c = 1/mass. 0 tokens: no probe.
    probe_tokens: int = 512
    probe_masses: tuple[float, ...] = (0.8,)
    # tokens per probe request: short requests fill a wide batch, where the probe's three
    # passes per step (two one-token draft passes, one verify) cost least per token
    probe_max_new: int = 32
    # timings of each audited prompt, plain and speculative side by side at batch 1, for the
    # slices' speedup intervals (audit/speed.py): the greedy runs' one and speed_repeats - 1
    # more, the order flipped repeat by repeat
    speed_repeats: int = 1
    # what the speedup-floor search may spend (audit/floor.py); None: the quick budget
    floor: FloorBudget | None = None

    def __post_init__(self):
        if min(self.max_new_tokens, self.distribution_max_new, self.probe_max_new) < 2:
            raise ValueError("max_new_tokens, distribution_max_new and probe_max_new must be >= 2")
        if min(self.distribution_tokens, self.short_context, self.long_context,
               self.load_rounds, self.load_steps, self.speed_repeats) < 1:
            raise ValueError("audit sizes must be positive")
        if self.probe_tokens < 0 or not self.probe_masses or not all(0 < m < 1 for m in self.probe_masses):
            raise ValueError("probe_tokens must be >= 0 and each probe mass in (0, 1)")

    @classmethod
    def quick(cls) -> "AuditSizes":
        return cls("quick", prompts_per_slice=2, max_new_tokens=24, distribution_tokens=2048,
                   distribution_max_new=64, seeded_prompts=8, seeded_max_new=24, short_context=100,
                   long_context=1000, long_max_batch=4, load_rounds=2, load_steps=3,
                   probe_tokens=512, probe_masses=(0.8,), probe_max_new=32, speed_repeats=3,
                   floor=FloorBudget.quick())

    @classmethod
    def full(cls) -> "AuditSizes":
        # measured with 96 seeded prompts x 48 tokens: seeded 820 s of a 2,049 s full audit
        # (six runs at T > 0, two of them at batch 1); 32 prompts (4 per slice) x 32 tokens,
        # greedy 40 tokens: 1,145 s in all
        return cls("full", prompts_per_slice=None, max_new_tokens=40, distribution_tokens=6144,
                   distribution_max_new=96, seeded_prompts=32, seeded_max_new=32, short_context=100,
                   long_context=1000, long_max_batch=16, load_rounds=2, load_steps=4,
                   probe_tokens=4096, probe_masses=(0.8, 0.9), probe_max_new=48, speed_repeats=4,
                   floor=FloorBudget.full())


@dataclass(frozen=True)
class SamplingSetting:
    """One sampling setting the sampled checks audit: a temperature and the filters the
    engine applies after it (sampling.py: top-k and top-p on the tempered logits, then min-p
    relative to the top token left), under the label the report names it by (default: its
    values, as describe() writes them)."""

    temperature: float
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    label: str = ""

    def __post_init__(self):
        self.params()  # ValueError naming a value the engine refuses
        if self.temperature == 0:
            raise ValueError("a sampled check needs temperature > 0, got 0 (greedy: the equivalence check)")
        if not self.label:
            object.__setattr__(self, "label", self.describe())

    def params(self, seed: int | None = None, coupled: bool | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, seed=seed, coupled=coupled)

    @property
    def filtered(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0

    def describe(self) -> str:
        """Its values as the report writes them: 'T=0.7, top-k 50, top-p 0.9, min-p 0.05', 'T=1, no filter'."""
        parts = [f"T={self.temperature:g}"] + ([f"top-k {self.top_k}"] if self.top_k else []) \
            + ([f"top-p {self.top_p:g}"] if self.top_p < 1.0 else []) \
            + ([f"min-p {self.min_p:g}"] if self.min_p > 0.0 else [])
        return ", ".join(parts) if self.filtered else parts[0] + ", no filter"

    def to_dict(self) -> dict:
        return {"label": self.label, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "min_p": self.min_p}


# Audited when no sampling setting is given: plain sampling, and the filters most deployments
# use, so that a verify pass that applies one in another place or order than plain decoding
# does (audit/faults/filters.py) fails the default audit. Min-p 0.1, not 0.05: after top-p 0.9
# at T = 0.7 SmolLM2's distributions keep little that 0.05 removes (1.0% of the mass on
# sampled chat text, 2.8% at 0.1). T = 0.7 also shows a verifier that ignores the
# temperature, which a third setting (the earlier T = 0.5) would only thin the shares for.
DEFAULT_SETTINGS = (SamplingSetting(1.0, label="plain"),
                    SamplingSetting(0.7, top_k=50, top_p=0.9, min_p=0.1, label="filtered"))


def settings_for(temperatures=(1.0,), top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
                 ) -> tuple[SamplingSetting, ...]:
    """A deployment's settings: each temperature under the same filters."""
    return tuple(SamplingSetting(t, top_k, top_p, min_p) for t in dict.fromkeys(temperatures))


@dataclass(frozen=True)
class AuditConfig:
    target: str = "smollm2-135m"  # preset, directory, GGUF file or hub id
    draft: str = "lookup"  # lookup[:N] | layerskip:N | a draft model
    k: int = 4  # drafts per step (FixedK), or the most the adaptive policy may draft
    policy: str = "adaptive"  # adaptive | fixed
    batch_invariant: bool = False  # the target runs in batch-invariant mode (models/attention.py)
    rule: str = "rejection"  # verification rule for sampled requests
    suite: str = "default"  # a packaged suite ("default", "repetitive") or a JSONL path
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    sizes: AuditSizes = field(default_factory=AuditSizes.full)
    seed: int = 0
    # the sampled checks (distribution, seeded) sample under each of these, requests taking
    # them in turn: by default plain T = 1 and a common filtered setting (DEFAULT_SETTINGS);
    # `verispec audit --temperature/--top-k/--top-p/--min-p` audits the deployment's instead
    settings: tuple[SamplingSetting, ...] = DEFAULT_SETTINGS
    # the distribution check is inconclusive (and fails) with fewer verified drafts
    min_verified_drafts: int = 200
    prompt_format: str = "auto"  # auto | chat | raw; auto = chat when the tokenizer has a template
    inject_fault: str | None = None  # test-only: a name from audit/faults/
    fail_fast: bool = False  # stop after the first failed check (the record lists those not run)
    only: tuple[str, ...] = ()  # run only these checks (and lossy-rule, record); () = all
    # the adaptive policy's cost model: read from (and, when measured, written to) the
    # machine's cost cache, as `generate` and `serve` do; False measures it afresh
    cost_cache: bool = False
    # the speedup-floor check's gate: it fails when a confirmed prompt runs below this
    # speedup with its whole interval below it (None: the floor is informational)
    min_speedup: float | None = None

    def __post_init__(self):
        if self.min_speedup is not None and not 0 < self.min_speedup < 100:
            raise ValueError(f"min_speedup must be a speedup in (0, 100), got {self.min_speedup}")
        if self.rule not in RULES:
            raise ValueError(f"unknown verification rule {self.rule!r}; valid: {', '.join(RULES)}")
        if self.policy not in ("adaptive", "fixed"):
            raise ValueError(f"policy must be adaptive or fixed, got {self.policy!r}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1 (the audit needs drafts to audit), got {self.k}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if not self.settings or not all(isinstance(s, SamplingSetting) for s in self.settings):
            raise ValueError(f"the sampled checks need at least one SamplingSetting, got {self.settings!r}")
        labels = [s.label for s in self.settings]
        if len(set(labels)) < len(labels):
            raise ValueError(f"sampling settings need distinct labels (the report names them), got {labels}")
        if self.min_verified_drafts < 0:
            raise ValueError(f"min_verified_drafts must be >= 0, got {self.min_verified_drafts}")
        if self.prompt_format not in ("auto", "chat", "raw"):
            raise ValueError(f"prompt_format must be auto, chat or raw, got {self.prompt_format!r}")
        names = selectable(ENGINE)  # --only's choices (lossy-rule and record always run)
        unknown = set(self.only) - set(names)
        if unknown:
            raise ValueError(f"unknown checks {sorted(unknown)}; checks: {', '.join(names)}")

    def setting_of(self, i: int) -> SamplingSetting:
        """The setting of the i-th sampled request: the audited ones in turn."""
        return self.settings[i % len(self.settings)]

    def sampling_of(self, i: int, seed: int | None = None, coupled: bool | None = None) -> SamplingParams:
        """The i-th sampled request's SamplingParams: its setting (setting_of), with this seed."""
        return self.setting_of(i).params(seed, coupled)

    @property
    def temperatures(self) -> tuple[float, ...]:
        """Each setting's temperature, in the settings' order."""
        return tuple(s.temperature for s in self.settings)

    @property
    def temperature(self) -> float:
        """The first setting's temperature."""
        return self.settings[0].temperature

    def temperature_of(self, i: int) -> float:
        """The temperature of the i-th sampled request (its setting's)."""
        return self.setting_of(i).temperature

    # The first setting's filters, for a reader that applies one top-k / top-p / min-p to
    # every request; the settings may differ in them, and sampling_of(i) gives request i's own.
    top_k = property(lambda self: self.settings[0].top_k)
    top_p = property(lambda self: self.settings[0].top_p)
    min_p = property(lambda self: self.settings[0].min_p)

    @property
    def forced_k(self) -> int:
        """The fixed k of the runs that force drafting beside an adaptive policy: enough
        drafts per step to exercise every speculative path, at most 4 (k = 8, the adaptive
        cap, would make each forced run cost twice as much for nothing the checks need)."""
        return min(self.k, 4)

    @property
    def greedy_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes of the greedy runs: always batch 1 (the slices compare it with plain)."""
        return tuple(sorted(set(self.batch_sizes) | {1}))


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Raw text exactly as tokenizer(text); chat wraps it in the model's template as a user turn."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer(text)["input_ids"])


def select_prompts(prompts: list[SuitePrompt], per_slice: int | None, seed: int = 0) -> list[SuitePrompt]:
    """per_slice prompts of each slice (None: all): the first ones with seed 0, so that audits
    with the default seed compare on the same prompts; a seeded sample of each slice otherwise."""
    if per_slice is None:
        return list(prompts)
    if seed == 0:
        return [p for group in slices(prompts).values() for p in group[:per_slice]]
    rng = random.Random(seed)
    return [p for group in slices(prompts).values() for p in rng.sample(group, min(per_slice, len(group)))]


@dataclass
class GreedyRuns:
    """Greedy outputs shared by equivalence, drafter consistency, corruption and slices."""

    reference: list[Request]  # plain decoding at batch 1, one per prompt
    speculative: dict[int, list[Request]]  # batch size -> one per prompt, prompt order
    seconds: float = 0.0
    # drafting forced: a fixed k at the largest batch size, where the deployed policy (when
    # adaptive) may draft little; None when the deployed policy is already a fixed k
    forced: tuple[int, list[Request]] | None = None


@dataclass
class AuditContext:
    config: AuditConfig
    model: Any  # CausalLM
    tokenizer: Any
    drafter_factory: DrafterFactory
    suite: list[SuitePrompt]  # the whole suite (long load-sweep prompts draw on it)
    prompts: list[SuitePrompt]  # the audited subset
    prompt_ids: list[list[int]]
    chat: bool
    stops: tuple[int, ...]
    progress: Any  # progress.Progress
    # the adaptive policy's cost model, one for the whole audit, as a server measures one for
    # its largest batch and serves every load with it: {"model", "max_batch", "source"}
    costs: dict = field(default_factory=dict)
    # how the engine under audit is built: Engine, or an injected fault's builder (runner.py
    # builds it: the faults name the checks they expect, so this module cannot import them)
    build_audited: Callable[..., Engine] = Engine

    def audited_engine(self, drafter, policy, config: EngineConfig, prompt_cache=None) -> Engine:
        """An engine of the system under audit on the audited model: with config.inject_fault
        it has that fault's hooks (audit/faults/), and no other engine of the audit does."""
        return self.build_audited(self.model, drafter, policy, config, prompt_cache=prompt_cache)

    def engine(self, batch: int, max_len: int, *, speculative: bool = True, policy=None,
               rule: str | None = None, wrap=None, prompt_caches=None) -> Engine:
        """An engine under audit (speculative) or a plain reference (not speculative: never
        with the injected fault); `wrap(policy)` may wrap the configured policy (load sweep).
        prompt_caches: (target's, draft model's) engine.PromptCache, for runs that time
        decoding only (the load sweep); the checks that compare outputs prefill afresh."""
        k = self.config.k
        drafter = self.drafter_factory(batch, max_len + k + 2) if speculative else None
        if prompt_caches is not None and drafter is not None and drafter.reuses_prefills:
            drafter.prompt_cache = prompt_caches[1]
        if policy is None:
            policy = FixedK(k if drafter is not None else 0)
            if drafter is not None and self.config.policy == "adaptive":
                policy = AdaptivePolicy(self.cost_model(batch, max_len), max_k=k)
        if wrap is not None:
            policy = wrap(policy)
        config = EngineConfig(max_batch=batch, max_len=max_len, rule=rule or self.config.rule, trace=True)
        prompt_cache = None if prompt_caches is None else prompt_caches[0]
        if not speculative:  # plain decoding: a reference, never under audit
            return Engine(self.model, drafter, policy, config, prompt_cache=prompt_cache)
        return self.audited_engine(drafter, policy, config, prompt_cache)

    def cost_model(self, batch: int, max_len: int):
        """The cost model every adaptive engine of the audit plans with: timed once, at the
        largest audited batch size (the grid covers every smaller one), like a server's for
        its max batch; from the machine's cost cache when the config says so."""
        B = max(max(self.config.batch_sizes), batch)
        if self.costs.get("max_batch", 0) < B:
            k = self.config.k
            drafter = self.drafter_factory(B, max_len + k + 2)
            # an audit with an injected fault neither reads nor writes the machine's cache
            use_cache = self.config.cost_cache and not self.config.inject_fault
            entry = CostCache.default().entry(self.model, drafter, B, k) if use_cache else None
            model = entry.load() if entry is not None else None
            source = f"read from the cost cache ({entry.path})" if model is not None else "measured by this audit"
            if model is None:
                t0 = time.perf_counter()
                model = measure_costs(self.model, drafter, B, k)
                source += f" in {time.perf_counter() - t0:.1f} s"
                if entry is not None and entry.save(model, "measured"):
                    source += f", written to the cost cache ({entry.path})"
            self.costs = {"model": model, "max_batch": B, "source": source}
        return self.costs["model"]

    def greedy_params(self) -> GenerationParams:
        return GenerationParams(max_new_tokens=self.config.sizes.max_new_tokens, stop_token_ids=self.stops)

    def sampled_params(self, setting: SamplingSetting, seed: int, max_new: int) -> GenerationParams:
        # the seed makes the run reproducible; the rule under audit decides how it is used:
        # keyed noise for `coupled`, a seeded generator (so rejection sampling is what gets
        # tested) for every other rule
        s = setting.params(seed, coupled=self.config.rule == "coupled")
        return GenerationParams(max_new_tokens=max_new, sampling=s, ignore_eos=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        """A prompt's ids as the audit sends it: in the chat template where the audit uses one."""
        return encode(self.tokenizer, text, self.chat)
