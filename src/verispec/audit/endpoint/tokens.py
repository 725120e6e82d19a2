"""The reference's own tokens and scores for the corruption signatures from outside.

A signature that counts repeats (a loop, repeated 4-grams) or averages a log-likelihood
(perplexity) depends on what a token is. Words are not the model's tokens: a short answer of
ten words can read as improbable when its per-word logprobs are summed from a server's own
token list, and a loop of sub-word tokens may not repeat at word level. Every output is
therefore tokenized by the *reference* server's own tokenizer (``/tokenize``: llama.cpp,
vLLM, verispec), and its perplexity is the reference's score of those tokens after the
prompt:

* vLLM and verispec: one /v1/completions request with the prompt's ids (its own chat
  template, from /tokenize with messages) plus the output's, ``prompt_logprobs`` = 0: each
  token's logprob;
* llama.cpp: its OpenAI routes score no prompt, so one /completion request a position
  (rescore.score_position, the slot keeping the prefix); a token outside the top-n listed
  is given the n-th logprob, a bound that can only lower the perplexity (a flag is then
  never the bound's doing);

Never the endpoint's own logprobs: a server whose cache is broken scores its own output with
the same broken cache.

Where the reference cannot tokenize (no /tokenize route), the check falls back to words and
says so.
"""

from __future__ import annotations

import asyncio
import math

import httpx

from .client import EndpointConfig

WORDS = "words (the reference has no /tokenize)"


class ReferenceTokens:
    """Tokenize and score texts with the reference server (`kind` as kinds.probe says)."""

    def __init__(self, cfg: EndpointConfig, kind: str):
        self.cfg, self.kind = cfg, kind
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.http = httpx.Client(base_url=cfg.base, headers=headers, timeout=cfg.timeout_s)
        self._model: str | None = cfg.model
        self._cache: dict[str, list[int] | None] = {}
        self.unit = f"the reference's tokens ({kind} /tokenize)"

    def close(self) -> None:
        self.http.close()

    def model(self) -> str:
        if self._model is None:
            self._model = self.http.get("/v1/models").json()["data"][0]["id"]
        return self._model

    def tokenize(self, text: str) -> list[int] | None:
        """The text's ids with no special tokens added (None: the reference cannot say)."""
        if text in self._cache:
            return self._cache[text]
        body = ({"model": self.model(), "prompt": text, "add_special_tokens": False} if self.kind == "vllm"
                else {"content": text, "add_special": False})
        ids = None
        try:
            r = self.http.post("/tokenize", json=body)
            if r.status_code == 200:
                got = r.json().get("tokens")
                ids = [t if isinstance(t, int) else t["id"] for t in got] if isinstance(got, list) else None
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            ids = None
        self._cache[text] = ids
        return ids

    def _prompt_ids(self, prompt: str, chat: bool) -> list[int]:
        if self.kind in ("vllm", "verispec"):
            body = ({"model": self.model(), "messages": [{"role": "user", "content": prompt}],
                     "add_generation_prompt": True} if chat else {"model": self.model(), "prompt": prompt})
            r = self.http.post("/tokenize", json=body)
            r.raise_for_status()
            return list(r.json()["tokens"])
        from .rescore import _Native, prompt_ids  # llama.cpp's native routes

        async def ids():
            api = _Native(self.cfg, 1)
            try:
                return await prompt_ids(api, prompt, chat)
            finally:
                await api.aclose()
        return asyncio.run(ids())

    def token_logprobs(self, prompt: str, chat: bool, ids: list[int]) -> list[float] | None:
        """The reference's logprob of each of `ids` after the prompt (None: it cannot score)."""
        if not ids:
            return None
        try:
            prompt_ids = self._prompt_ids(prompt, chat)
            if self.kind in ("vllm", "verispec"):
                body = {"model": self.model(), "prompt": prompt_ids + list(ids), "max_tokens": 1,
                        "temperature": 0.0, "prompt_logprobs": 0}
                r = self.http.post("/v1/completions", json=body)
                r.raise_for_status()
                got = r.json()["choices"][0]["prompt_logprobs"]
                return [got[len(prompt_ids) + j][str(t)]["logprob"] for j, t in enumerate(ids)]
            if self.kind == "llama.cpp":
                return asyncio.run(self._llama_cpp_logprobs(prompt_ids, list(ids)))
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None
        return None

    async def _llama_cpp_logprobs(self, prompt_ids: list[int], ids: list[int]) -> list[float]:
        from .rescore import _Native, score_position
        from .sampled import sampler_settings
        api = _Native(self.cfg, 1)
        out = []
        try:
            for j, t in enumerate(ids):
                top = await score_position(api, prompt_ids + ids[:j], sampler_settings("llama.cpp"))
                if not top:
                    raise ValueError("the reference listed no logprobs")
                listed = dict(top)
                out.append(listed.get(t, min(listed.values())))  # outside the top n: the n-th, a bound
        finally:
            await api.aclose()
        return out

    def perplexity(self, prompt: str, chat: bool, ids: list[int]) -> float | None:
        lps = self.token_logprobs(prompt, chat, ids)
        if not lps:
            return None
        return math.exp(-sum(lps) / len(lps))
