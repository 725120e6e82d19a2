"""Re-created historical speculative-decoding bugs, engine side: output processing (stops, max_tokens, logprobs) and the speculative counters
(see sitecustomize.py for how a patch is applied)."""

BUGS: dict = {}  # name -> (vLLM module, patch(module) -> None)
