"""Shared pieces of the server tests: a character tokenizer, tiny models, a live server."""

from __future__ import annotations

import functools
import socket
import threading
import time

import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.lookup import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.policy import FixedK
from verispec.sampling import SamplingParams
from verispec.server import ServerConfig, ServerState, create_app
from verispec.server.worker import PerRequestPolicy

V = 97
MODEL = "tiny"


class CharTokenizer:
    """One token per character: ids 0..94 are printable ASCII, 95 is a newline, 96 is EOS."""

    eos_token_id = 96
    chat_template = "<role>content\\n ... <assistant>"

    def __len__(self):
        return V

    def encode(self, text: str) -> list[int]:
        return [95 if c == "\n" else (ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32) for c in text]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:  # it has no special tokens to add
        return {"input_ids": self.encode(text)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            if i == self.eos_token_id:
                out.append("" if skip_special_tokens else "</s>")
            else:
                out.append("\n" if i == 95 else chr(i + 32))
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def _tiny(noise: float = 0.0):
    """tiny_hf with its weights scaled up x10: HF's init (std 0.02) leaves a tiny model with
    nearly flat logits that repeats one character; scaled, outputs differ per prompt."""
    hf = tiny_hf("qwen2", seed=0, vocab=V)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name and not name.endswith("bias"):
                p.mul_(10.0)
            if noise:
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    return native_from_hf(hf)


@functools.lru_cache(maxsize=None)
def target_model():
    return _tiny()


@functools.lru_cache(maxsize=None)
def draft_model():
    """The target's weights plus 2% noise: agrees on ~2/3 of drafts (the ragged case)."""
    return _tiny(noise=0.02)


class SlowTarget:
    """The tiny target with a sleep per forward pass, so requests last long enough to be
    cut off, queued or refused on purpose."""

    def __init__(self, inner, delay_s: float):
        self.inner, self.delay_s = inner, delay_s
        self.config = inner.config

    def new_cache(self, *a, **kw):
        return self.inner.new_cache(*a, **kw)

    def forward(self, *a, **kw):
        time.sleep(self.delay_s)
        return self.inner.forward(*a, **kw)


def make_state(drafter: str | None = "draft", k: int = 3, max_batch: int = 8, max_len: int = 256,
               max_queue: int = 16, api_key: str | tuple[str, ...] | None = None, rule: str = "rejection",
               delay_s: float = 0.0, model: str = "target", policy: str = "fixed",
               metrics_public: bool = False, drain_timeout_s: float = 30.0) -> ServerState:
    """model "draft" serves the draft model as the target: a server that answers differently.
    policy "adaptive": the adaptive policy on a cost model where drafting pays (so that it
    drafts, and halts rows, on the tiny models whatever this machine's timings)."""
    target = target_model() if model == "target" else draft_model()
    target = target if not delay_s else SlowTarget(target, delay_s)
    d = {"draft": lambda: DraftModelDrafter(draft_model(), V, max_rows=max_batch, max_len=max_len + k + 2),
         "lookup": lambda: PromptLookupDrafter(3), None: lambda: None,
         "suffix": lambda: SuffixDrafter(SuffixSettings(min_token_prob=0.0))}[drafter]()
    if policy == "adaptive" and d is not None:
        from verispec.policy.adaptive import AdaptivePolicy, CostModel
        costs = CostModel.from_total_tokens((1, 64, 1024), (1.0, 1.0, 3.0), (1, 64), (0.15, 0.25),
                                            halts=drafter == "draft", draft_free=drafter in ("lookup", "suffix"))
        pol = AdaptivePolicy(costs, max_k=k)
    else:
        pol = FixedK(k if d is not None else 0)
    # served: rows whose request says "speculate": false draft nothing
    engine = Engine(target, d, PerRequestPolicy(pol),
                    EngineConfig(max_batch=max_batch, max_len=max_len, rule=rule))
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    return ServerState(engine, CharTokenizer(), ServerConfig(model_name=MODEL, api_key=keys[0] if keys else None,
                                                             more_api_keys=keys[1:],
                                                             metrics_public=metrics_public,
                                                             max_queue=max_queue, drafter=drafter,
                                                             drain_timeout_s=drain_timeout_s))


def plain_reference(prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool = False,
                    sampling: list | None = None):
    """Offline plain decoding (no drafter) of the same prompts: [(output ids, finish reason)].
    sampling: per prompt SamplingParams (default greedy); a seeded (keyed) one gives the
    tokens that the server must give with or without speculation."""
    eng = Engine(target_model(), None, FixedK(0), EngineConfig(max_batch=8, max_len=256))
    stops = () if ignore_eos else (CharTokenizer.eos_token_id,)
    sampling = sampling or [SamplingParams()] * len(prompts)
    reqs = [Request(p, GenerationParams(max_new_tokens=m, stop_token_ids=stops, sampling=sp))
            for p, m, sp in zip(prompts, max_tokens, sampling)]
    eng.run(reqs)
    return [(r.output_ids, r.finish_reason) for r in reqs]


def reference_text(prompt_text: str, max_tokens: int, chat: bool = False) -> tuple[str, str]:
    tok = CharTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt_text}]) if chat else tok.encode(prompt_text)
    out, reason = plain_reference([ids], [max_tokens])[0]
    return tok.decode(out, skip_special_tokens=True), reason


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class LiveServer:
    """uvicorn on 127.0.0.1 (a free port) in a thread; stopped on exit."""

    def __init__(self, state: ServerState):
        import uvicorn
        self.state = state
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), log_level="warning", lifespan="on"))
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as written)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in scrape(text).items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


class Served:
    """An ASGI app (a test's proxy or fake server) served on 127.0.0.1 (a free port) in a thread."""

    def __init__(self, app):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.sock = free_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the app did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
