"""teacher_forced_logits with a prefix cache: the audit scores several outputs of each
prompt (the distribution check's sampled and probe requests, corruption's reference and
speculative outputs), and prefills each prompt once. The logits must be the very numbers
a fresh batch-1 prefill gives, for the full model and for the layer-skip draft."""

import torch

from tests.tiny import native_from_hf, tiny_hf
from verispec.audit.equivalence import prefix_cache, teacher_forced_logits


def test_prefix_cache_gives_the_fresh_prefill_numbers():
    model = native_from_hf(tiny_hf("llama", embed_scale=20.0))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (9, 23)]
    for num_layers in (None, 2):
        prefixes = prefix_cache()
        for round_ in range(3):  # three outputs of each prompt
            for prompt in prompts:
                out = torch.randint(0, 97, (5 + 3 * round_,), generator=g).tolist()
                seq = prompt + out
                fresh = teacher_forced_logits(model, seq[:-1], first=len(prompt) - 1, num_layers=num_layers)
                cached = teacher_forced_logits(model, seq[:-1], first=len(prompt) - 1, num_layers=num_layers,
                                               prefixes=prefixes)
                assert cached.shape == (len(out), 97)
                assert torch.equal(fresh, cached), (num_layers, round_)
        # the first output of each prompt prefilled it; the other two restored it
        assert (prefixes.misses, prefixes.hits) == (2, 4)

