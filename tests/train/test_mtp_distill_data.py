"""Distillation rows from the model's own greedy continuations: what is generated, how rows are
padded and which labels count."""

from __future__ import annotations

import pytest
import torch

from deltamoe.model.model import IGNORE_INDEX
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.train.mtp_distill import DistillBatch, distill_mtp, trunk_targets
from deltamoe.train.mtp_distill_data import Continuation, continuation_batches, frozen_trunk_batches, own_continuations
from tests.train.test_mtp_distill import small_model

PAD = 258


def test_continuations_are_the_prompt_then_the_models_greedy_tokens():
    model = small_model()
    prompts = [[256, 97, 98, 124], [256, 49, 43, 50, 61, 52]]
    rows = own_continuations(LLMEngine(model, config=EngineConfig(cache_memory="8MiB")), prompts, 8)
    assert [r.prompt_len for r in rows] == [4, 6]
    ids = list(prompts[0])
    with torch.no_grad():  # greedy, EOS ignored, token by token with full forwards
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert rows[0].token_ids == ids and len(rows[1].token_ids) == 6 + 8
    with pytest.raises(ValueError, match="new_tokens"):
        own_continuations(LLMEngine(model, config=EngineConfig(cache_memory="8MiB")), prompts, 2)


def test_batches_pad_and_score_only_the_continuation():
    rows = [Continuation([1, 2, 3, 4, 5, 6], 2), Continuation([7, 8, 9, 10], 1), Continuation([11, 12, 13], 1)]
    batches = list(continuation_batches(rows, 2, 3, PAD, seed=0))
    assert len(batches) == 3 and all(b.input_ids.shape[0] == 2 for b in batches)
    seen = [tuple(r[r != PAD].tolist()) for b in batches for r in b.input_ids]
    assert sorted(seen[:3]) == sorted(tuple(r.token_ids) for r in rows)  # one shuffled pass, then the next
    for b in batches:
        for ids, scored in zip(b.input_ids, b.scored):
            row = next(r for r in rows if r.token_ids == ids[ids != PAD].tolist())
            n = len(row.token_ids)
            assert (ids[n:] == PAD).all()
            assert scored.tolist() == [row.prompt_len + 1 <= j < n for j in range(len(ids))]


def test_unscored_labels_are_ignored_and_do_not_move_the_loss():
    model = small_model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[:, 6:] = True
    _, labels = trunk_targets(model, ids, PAD, scored)
    _, every = trunk_targets(model, ids, PAD)
    assert (labels[:, :6] == IGNORE_INDEX).all() and torch.equal(labels[:, 6:], every[:, 6:])
    # The loss counts the scored labels only: finite, and not the loss over every label.
    masked = distill_mtp(small_model(), [DistillBatch(ids, scored)], depth=2)[0]
    full = distill_mtp(small_model(), [ids], depth=2)[0]
    assert torch.isfinite(torch.tensor(masked)) and abs(masked - full) > 1e-4


def test_frozen_trunk_batches_carry_the_trunk_targets_of_the_same_batches():
    model = small_model()
    gen = torch.Generator().manual_seed(2)
    rows = [Continuation(torch.randint(0, 256, (n,), generator=gen).tolist(), p) for n, p in [(12, 3), (9, 2), (14, 5)]]
    plain = list(continuation_batches(rows, 2, 3, PAD, seed=1))
    frozen = list(frozen_trunk_batches(model, rows, 2, 3, seed=1, chunk=2))
    for a, b in zip(plain, frozen, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.scored, b.scored)
        h, labels = trunk_targets(model, a.input_ids, PAD, a.scored)
        assert torch.equal(b.labels, labels)
        real = a.input_ids != PAD
        torch.testing.assert_close(b.hidden[real], h[real], atol=1e-5, rtol=1e-5)
    # The same steps either way: the MTP layer sees the same states and targets.
    losses = [distill_mtp(small_model(), batches, depth=2, lr=3e-3) for batches in (plain, frozen)]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), atol=1e-4, rtol=1e-4)


def test_fresh_answer_batches_draw_new_examples_every_step():
    from deltamoe.train.data.tasks import make_task
    from deltamoe.train.mtp_distill_data import fresh_answer_batches

    tasks = {t.name: t for t in make_task("copy+repeat", string_len=6).tasks}
    raw = lambda text: [256] + list(text.encode())  # noqa: E731
    tagged = lambda text: [259] + list(text.encode()) + [260]  # noqa: E731
    answer = lambda text: list(text.encode())  # noqa: E731
    spec = {"copy": (tasks["copy"], 2), "repeat": (tasks["repeat"], 1)}
    batches = list(fresh_answer_batches(spec, [raw, tagged], answer, 257, PAD, steps=3, seed=4))
    again = list(fresh_answer_batches(spec, [raw, tagged], answer, 257, PAD, steps=3, seed=4))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again))  # seeded
    assert all(b.input_ids.shape[0] == 3 * 2 for b in batches)
    rows_per_step = [{tuple(r[r != PAD].tolist()) for r in b.input_ids} for b in batches]
    assert not rows_per_step[0] & rows_per_step[1] and not rows_per_step[1] & rows_per_step[2]  # new every step
    for ids, scored in zip(batches[0].input_ids, batches[0].scored):
        row = ids[ids != PAD].tolist()
        assert row[-1] == 257 and row[0] in (256, 259)
        # The prompt ends at its last query mark (the tagged encoder's 260 after it); the answer, then
        # EOS, follows and only it is scored, from the label of the first answer token on.
        start = max(i for i, t in enumerate(row) if t in (ord("|"), 260)) + 1
        answer_text = bytes(row[start:-1]).decode()
        assert answer_text.isalpha() and answer_text.islower()
        assert scored.tolist() == [start <= j < len(row) for j in range(len(ids))]
    with pytest.raises(ValueError, match="task"):
        next(fresh_answer_batches({"copy": (tasks["copy"], 0)}, [raw], answer, 257, PAD, steps=1))
