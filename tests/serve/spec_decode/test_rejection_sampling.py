"""Rejection sampling keeps the target distribution, whatever the draft distribution.

With K = 2 drafts on hand-made distributions over a small vocabulary, the first emitted token
is distributed as p_0, and the token after an accepted first draft as p_1: a chi-square test
over many independent draws (a cheap run by default, a heavy one over several distributions
behind -m slow)."""

from __future__ import annotations

import pytest
import torch

from deltamoe.serve.spec_decode.acceptance import accept_greedy, rejection_sample

# Chi-square critical values at alpha = 1e-4 (a correct sampler fails one run in 10,000).
CHI2_CRITICAL = {3: 21.11, 4: 23.51, 5: 25.74, 7: 29.88}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of zero target probability was emitted"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def emitted_counts(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts of the first emitted token, and of the second one when the first draft was kept."""
    v = p.shape[-1]
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(v), torch.zeros(v)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(q.shape[0])]
        tokens = rejection_sample(p, q, drafts, g)
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
    return first, second, trials


def distributions(v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(3, v, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, v, generator=g) * 1.5, -1)
    p[0, 0] = 0.0  # a token the target never emits, which the draft proposes
    p[0] /= p[0].sum()
    q[0, 0] = max(float(q[0, 0]), 0.2)
    q[0] /= q[0].sum()
    return p, q


def check(v: int, trials: int, seed: int) -> None:
    p, q = distributions(v, seed)
    first, second, _ = emitted_counts(p, q, trials, seed)
    assert chi_square(first, p[0]) < CHI2_CRITICAL[v - 2]  # p[0, 0] = 0: one fewer degree of freedom
    if second.sum() >= 200:
        assert chi_square(second, p[1]) < CHI2_CRITICAL[v - 1]


def test_rejection_sampling_keeps_the_target_distribution():
    check(v=5, trials=3000, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_rejection_sampling_keeps_the_target_distribution_heavy(seed):
    check(v=6 if seed % 2 else 5, trials=40_000, seed=100 + seed)


def test_a_wrong_sampler_fails_the_test():
    """The test can fail: emitting the draft unconditionally gives q's distribution, not p's."""
    p, q = distributions(5, 1)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(3000):
        counts[int(torch.multinomial(q[0], 1, generator=g))] += 1
    with pytest.raises(AssertionError):
        assert chi_square(counts, p[0]) < CHI2_CRITICAL[3]


def test_same_target_and_draft_keeps_every_draft():
    p = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(0)), -1)
    g = torch.Generator().manual_seed(0)
    assert len(rejection_sample(p, p[:2], [1, 2], g)) == 3


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]
    assert accept_greedy([4, 9, 6], [4, 5]) == [4, 9]
    assert accept_greedy([3, 5, 6], [4, 5]) == [3]
