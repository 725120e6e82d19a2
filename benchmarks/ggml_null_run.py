"""Null run on the ggml backend: plain decoding at batch 4 and 16 against plain decoding at batch 1
(32 suite prompts, chat template, 32 new tokens), divergences classified by the reference top-2
margin against the measured noise (models/noise.py): how much batching alone, with no speculation,
changes greedy output.

    python benchmarks/ggml_null_run.py smollm2-135m
"""
import sys, torch
torch.set_num_threads(2)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
from verispec.audit.context import encode, select_prompts
from verispec.audit.equivalence import compare, reference_logits_at
from verispec.audit.suite import load_suite
from verispec.engine import Engine, EngineConfig, GenerationParams, Request
from verispec.models import load_model
from verispec.models.noise import batching_noise
from verispec.policy import FixedK
spec = sys.argv[1]
lm = load_model(spec, backend="ggml", progress=False)
m, tok = lm.model, lm.tokenizer
prompts = [encode(tok, p.prompt, True) for p in select_prompts(load_suite("default"), 4)]
L = max(map(len, prompts)) + 34
noise = batching_noise(m)
def run(b):
    eng = Engine(m, None, FixedK(0), EngineConfig(max_batch=b, max_len=L))
    reqs = [Request(p, GenerationParams(max_new_tokens=32)) for p in prompts]
    eng.run(reqs); return [r.output_ids for r in reqs]
ref = run(1)
for b in (4, 16):
    got = run(b)
    cs = [compare(prompts[i], ref[i], got[i], lambda pr, r, ix: reference_logits_at(m, pr, r, ix), tie_margin=noise["margin"]) for i in range(len(prompts))]
    print(f"{spec} ggml null run, plain b={b} vs plain b=1: {sum(c.exact for c in cs)}/{len(cs)} identical; "
          f"margins {sorted(round(c.margin, 3) for c in cs if c.margin is not None)}; clear divergences {sum(c.verdict == 'divergence' for c in cs)}; noise {noise}", flush=True)
