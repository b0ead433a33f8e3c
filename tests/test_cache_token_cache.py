"""The camera head's token cache: masked attention over its capacity equals attention over exactly
the live tokens, through growth, commits and rollbacks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stream_recon.cache import TokenCache


def test_token_cache_matches_attention_over_the_live_tokens():
    generator = torch.Generator().manual_seed(0)
    cache = TokenCache(2, 2, 4, torch.float64, "cpu", capacity=3)
    live: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]  # per layer: committed (k, v) rows
    for step, count in enumerate([3, 1, 1, 2, 1, 1, 1, 1]):
        cache.begin(count)
        for layer in range(2):
            q, k, v = (torch.randn(count, 2, 4, generator=generator, dtype=torch.float64) for _ in range(3))
            keys = torch.cat([row[0] for row in live[layer]] + [k]) if live[layer] else k
            values = torch.cat([row[1] for row in live[layer]] + [v]) if live[layer] else v
            expected = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1))
            torch.testing.assert_close(cache(layer, q, k, v), expected.transpose(0, 1), rtol=0, atol=1e-12)
            if step % 3 != 2:
                live[layer].append((k, v))
        (cache.rollback if step % 3 == 2 else cache.commit)()
    assert cache.num_committed == sum(k.shape[0] for k, _ in live[0])
    assert cache.capacity >= cache.num_committed and cache.version >= 1  # it grew past 3 tokens


def test_clear_forgets_every_token_and_zeroes_the_storage():
    """What `reset` keeps (the values past the live tokens, weighed by zero: NaN there would still show
    through) `clear` zeroes."""
    cache = TokenCache(2, 2, 4, torch.float32, "cpu", capacity=3)
    cache.begin(2)
    nan = torch.full((2, 2, 4), float("nan"))
    cache(0, torch.ones(2, 2, 4), nan, nan)
    cache.commit()
    cache.reset()
    cache.begin(1)
    assert cache(0, torch.ones(1, 2, 4), torch.ones(1, 2, 4), torch.ones(1, 2, 4)).isnan().all()  # reset kept them
    cache.rollback()
    cache.clear()
    cache.begin(1)
    assert cache.num_committed == 0 and (cache(0, *(torch.ones(1, 2, 4) for _ in range(3))) == 1).all()
