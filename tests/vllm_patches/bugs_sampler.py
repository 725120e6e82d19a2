"""Re-created historical speculative-decoding bugs, sampling side: the rejection sampler, the sampler, logits processing and seeds
(see sitecustomize.py for how a patch is applied)."""

BUGS: dict = {}  # name -> (vLLM module, patch(module) -> None)
