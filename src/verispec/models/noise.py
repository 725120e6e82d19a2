"""A backend's own batching noise, measured on the model itself (any CausalLM).

Greedy speculative decoding equals plain decoding only up to the numerics of the backend:
a verify pass over k + 1 tokens, a batch of rows and a KV cache whose cells were freed
and refilled all change the order in which floats are summed, and on quantized weights
(activations rounded to 8 bits per block) a last-bit difference can move a logit by a
visible amount. A divergence is numerics only where the reference's top-2 margin lies
inside this noise; the bound is measured here, never assumed.
"""

from __future__ import annotations

import torch


def _ids(V: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


def _one_pass(model, seq: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, len(seq) + 1)
    return model.forward(torch.tensor([seq]), cache, cache.alloc())[0]  # [T,V]


def _diff(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """ref, got [T,V] -> (largest logit difference, largest change of the gap between ref's
    top-2 tokens: what decides whether a greedy choice can flip)."""
    top = ref.topk(2, dim=-1).indices  # [T,2]
    gap_ref = ref.gather(-1, top[:, :1]) - ref.gather(-1, top[:, 1:])
    gap_got = got.gather(-1, top[:, :1]) - got.gather(-1, top[:, 1:])
    return float((ref - got).abs().max()), float((gap_ref - gap_got).abs().max())


def batching_noise(model, seeds=(0, 1), context: int = 264, tail: int = 12) -> dict[str, float]:
    """{"logit": the largest logit difference, "margin": the largest change of the top-2
    gap}, over a few random rows, between a fresh single-row one-pass decode of the row and:

    (a) the same row's last `tail` tokens decoded one token per pass after `context`
        cached positions (past 256 positions llama.cpp's attention takes another kernel
        for a one-token pass than for a wider one; on Q4_K files, blocks of 4 tokens take
        another matrix kernel than the remainder);
    (b) the same row decoded beside another row that leaves the batch, so that its later
        tokens are stored in the cells the other freed, before its earlier ones (an
        attention that sums in storage order then sums in another order; continuous
        batching does this to every row).

    No rollback is involved: a difference the engine shows beyond this bound is not noise.
    A batch-invariant backend measures 0. A greedy divergence at a reference top-2 margin
    below "margin" can be numerics; one above it cannot be these effects."""
    V = model.config.vocab_size
    worst = {"logit": 0.0, "margin": 0.0}

    def note(ref, got):
        for key, v in zip(("logit", "margin"), _diff(ref, got)):
            worst[key] = max(worst[key], v)

    for seed in seeds:
        seq = _ids(V, context + tail, seed)
        one = _one_pass(model, seq)
        cache = model.new_cache(1, len(seq) + 1)
        row = cache.alloc()
        model.forward(torch.tensor([seq[:context]]), cache, row, last_only=True)
        inc = torch.cat([model.forward(torch.tensor([[t]]), cache, row)[0] for t in seq[context:]])
        note(one[context:], inc)
        other = _ids(V, 40, seed + 100)
        cache = model.new_cache(2, 80)
        a, b = cache.alloc(2)
        model.forward(torch.tensor([other]), cache, [b])
        model.forward(torch.tensor([seq[:20]]), cache, [a])
        cache.free([b])
        late = model.forward(torch.tensor([seq[20:60]]), cache, [a])[0]
        note(one[20:60], late)
    return worst


def rollback_difference(model, lengths=(20, 35, 7, 50, 13), cuts=(10, 30, 3, 25, 13), seed: int = 0) -> float:
    """The largest logit difference between rows decoded the way the engine decodes them and
    a fresh single-row one-pass decode of each: rows at different lengths prefilled together
    (not on rows 0..B-1), given rejected drafts of different lengths twice, rolled back to
    `cuts` and then fed the rest of their tokens ragged in one pass (a row whose cut is its
    length idles). A correct cache stays inside batching_noise()["logit"]."""
    V = model.config.vocab_size
    B = len(lengths)
    seqs = [_ids(V, n, seed + i) for i, n in enumerate(lengths)]
    ref = [_one_pass(model, s) for s in seqs]
    cache = model.new_cache(B + 1, max(lengths) + 16)
    rows = cache.alloc(B + 1)[1:]
    x = torch.zeros(B, max(cuts), dtype=torch.long)  # [B,T]
    for b, s in enumerate(seqs):
        x[b, :cuts[b]] = torch.tensor(s[:cuts[b]])
    model.forward(x, cache, rows, list(cuts), last_only=True)
    g = torch.Generator().manual_seed(seed + 1000)
    for n_rejected in ([5, 3, 0, 2, 8], [1, 0, 4, 4, 2]):
        n_rejected = (n_rejected * B)[:B]
        model.forward(torch.randint(0, V, (B, 8), generator=g), cache, rows, n_rejected)
        cache.truncate(rows, list(cuts))
    rest = [n - c for n, c in zip(lengths, cuts)]
    x = torch.zeros(B, max(rest), dtype=torch.long)
    for b, s in enumerate(seqs):
        x[b, :rest[b]] = torch.tensor(s[cuts[b]:])
    out = model.forward(x, cache, rows, rest)  # [B,T,V]
    if cache.lengths[rows].tolist() != list(lengths):
        raise AssertionError(f"row lengths {cache.lengths[rows].tolist()} after the feed, not {list(lengths)}")
    return max(float((out[b, :rest[b]] - ref[b][cuts[b]:]).abs().max()) for b in range(B) if rest[b])


def churn_difference(model, rows: int = 3, steps: int = 20, max_len: int = 150, seed: int = 0) -> float:
    """The largest logit difference between a cache used the way continuous batching with
    speculation uses it and a fresh single-row one-pass decode of each row's tokens. Each
    step feeds every row in use one ragged pass (a new row its prompt of 1-40 tokens, the
    others 1-8 tokens, as a verify pass), keeps a random part of each pass and rolls the
    rest back; rows leave at random or near max_len, and new rows take their places, on
    cache rows in any order. Every logit of every pass is compared. A batch-invariant
    backend measures 0; a noisy one stays inside batching_noise()["logit"]."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)

    def rand(lo, hi):  # an int in [lo, hi]
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    cache = model.new_cache(rows, max_len)
    kept: dict[int, list[int]] = {}  # row -> its committed tokens
    worst = 0.0
    for _ in range(steps):
        while cache.rows_in_use < rows and (not kept or rand(0, 1)):
            kept[cache.alloc()[0]] = []
        active = sorted(kept)
        feed = [torch.randint(0, V, (rand(1, 40) if not kept[r] else rand(1, 8),), generator=g).tolist()
                for r in active]
        x = torch.zeros(len(active), max(map(len, feed)), dtype=torch.long)  # [B,T]
        for b, f in enumerate(feed):
            x[b, :len(f)] = torch.tensor(f)
        out = model.forward(x, cache, active, [len(f) for f in feed])  # [B,T,V]
        for b, r in enumerate(active):
            full = kept[r] + feed[b]
            ref = _one_pass(model, full)[len(kept[r]):]
            worst = max(worst, float((out[b, :len(feed[b])] - ref).abs().max()))
            keep = len(feed[b]) if not kept[r] else rand(0, len(feed[b]))
            kept[r] = full[:len(kept[r]) + keep]
        cache.truncate(active, [len(kept[r]) for r in active])
        for r in active:
            if len(kept[r]) > max_len - 50 or rand(0, 5) == 0:
                cache.free([r])
                del kept[r]
    return worst
