"""Contract 1: token-by-token decode (and chunked prefill) gives the full-forward logits, for every member."""

import torch

from deltamoe.model.cache import ContiguousCache
from deltamoe.model.load import build_model


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_decode_matches_full_forward(member_config):
    torch.manual_seed(0)
    model = build_model(member_config, seed=1).eval()
    ids = torch.randint(0, member_config.vocab_size, (2, 19))  # T=19 > index_topk=5 for the DSA member
    with torch.no_grad():
        full = model(ids).logits
        cache = ContiguousCache(member_config, batch_size=2, max_length=32)
        steps = [model(ids[:, t:t + 1], cache=cache).logits for t in range(ids.shape[1])]
    assert rel_err(torch.cat(steps, 1), full) <= 1e-5


def test_chunked_prefill_then_decode_matches(member_config):
    model = build_model(member_config, seed=2).eval()
    ids = torch.randint(0, member_config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids).logits
        cache = ContiguousCache(member_config, batch_size=2, max_length=32)
        # chunks larger than the absorbed-form threshold, smaller, and single tokens
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in ((0, 17), (17, 20), (20, 21), (21, 23))]
    assert rel_err(torch.cat(parts, 1), full) <= 1e-5


def test_rows_with_different_past_lengths(member_config):
    """A batch whose rows sit at different positions decodes each row as if it were alone."""
    model = build_model(member_config, seed=4).eval()
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, member_config.vocab_size, (1, 9), generator=g)
    b = torch.randint(0, member_config.vocab_size, (1, 6), generator=g)
    with torch.no_grad():
        ref_a, ref_b = model(a).logits[:, -1], model(b).logits[:, -1]
        # prefill each row separately into a shared cache, then decode both last tokens together
        cache = ContiguousCache(member_config, batch_size=2, max_length=16)
        ca = ContiguousCache(member_config, batch_size=1, max_length=16)
        cb = ContiguousCache(member_config, batch_size=1, max_length=16)
        model(a[:, :-1], cache=ca)
        model(b[:, :-1], cache=cb)
        for layer in range(member_config.num_hidden_layers):
            conv_a, rec_a = ca.kda_state(layer)
            if rec_a is not None:
                conv_b, rec_b = cb.kda_state(layer)
                cache.set_kda_state(layer, torch.cat([conv_a, conv_b]), torch.cat([rec_a, rec_b]))
        for store in ("_latent", "_index_keys"):
            for layer, buf in getattr(ca, store).items():
                getattr(cache, store)[layer] = torch.cat([buf, getattr(cb, store)[layer]])
        cache.past_lengths = torch.tensor([8, 5])
        last = model(torch.cat([a[:, -1:], b[:, -1:]]), cache=cache).logits[:, 0]
    assert rel_err(last[0], ref_a[0]) <= 1e-5 and rel_err(last[1], ref_b[0]) <= 1e-5
