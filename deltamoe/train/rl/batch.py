"""The rollout batch as training tensors: rows of input tokens and the sampled tokens scored on them.

A group's G completions share their prompt and often repeat each other (recall's answer is one
byte out of ten values: a group of 8 holds a handful of distinct answers). Two exact savings
follow, so that many more prompts per update cost little more than the rollouts:

- **Identical completions of one prompt are scored once, weighted by their count.** They have the
  same tokens, hence the same logprobs (old, new and reference) and the same reward, hence the same
  advantage: their loss terms are equal, so one term times the count is their sum.
- **A row is prompt + completion[:-1].** Position t predicts token t + 1, so a completion's last
  token is never the input of a scored position. Completions that differ only in their last token
  share a row; one-token completions (recall's answer, `--completion answer`) all share the prompt's
  row: the trainer forwards each prompt once and scores every sampled answer at its last position.

`plain=True` lays the batch out as one row per sample with no sharing: the readable reference the
shared layout is tested against (same loss, same gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltamoe.train.rl.rollout import Sample


@dataclass
class RolloutTensors:
    """Input rows (right-padded) and the N scored tokens: row `row[i]`'s position `pos[i]` predicts
    `token[i]`, which stands for `weight[i]` sampled completions (identical ones counted)."""

    ids: torch.Tensor  # [R, T]
    row: torch.Tensor  # [N] long
    pos: torch.Tensor  # [N] long
    token: torch.Tensor  # [N] long
    weight: torch.Tensor  # [N] float: completions this scored token stands for
    advantage: torch.Tensor  # [N] float: its completion's advantage
    engine_logp: torch.Tensor  # [N] float: the engine's logprob of the token when it sampled it

    def block(self, rank: int, ranks: int) -> RolloutTensors:
        """Data rank `rank`'s share: a contiguous block of rows and the tokens scored on them. Every
        rank gets the same number of rows: rows past the batch are copies of row 0 with nothing
        scored on them (no loss, no gradient), because FSDP2's gathers need every rank in every forward."""
        per_rank = -(-self.ids.shape[0] // ranks)
        rows = torch.arange(rank * per_rank, (rank + 1) * per_rank)
        ids = self.ids[torch.where(rows < self.ids.shape[0], rows, 0)]
        mine = (self.row >= rank * per_rank) & (self.row < (rank + 1) * per_rank)
        return RolloutTensors(ids, self.row[mine] - rank * per_rank, self.pos[mine], self.token[mine],
                              self.weight[mine], self.advantage[mine], self.engine_logp[mine])


def rollout_tensors(samples: list[Sample], advantages: list[float], pad: int, plain: bool = False) -> RolloutTensors:
    """`samples` (each with its prompt, completion tokens and engine logprobs) and their advantages ->
    the training batch; shared rows and counted duplicates unless `plain`."""
    rows: dict[tuple, int] = {}  # (prompt index, completion[:-1]) -> row
    scored: dict[tuple, int] = {}  # (row, completion) -> its first scored token's index
    inputs: list[list[int]] = []
    row, pos, token, weight, advantage, engine_logp = [], [], [], [], [], []
    for k, (s, a) in enumerate(zip(samples, advantages)):
        prompt, completion = s.prompt.token_ids, s.token_ids
        key = (k,) if plain else (s.prompt_index, tuple(completion[:-1]))
        r = rows.setdefault(key, len(rows))
        if r == len(inputs):
            inputs.append(prompt + completion[:-1])
        first = scored.get((r, tuple(completion)))
        if first is not None:  # an identical completion of the same prompt: same terms, counted
            if advantage[first] != float(a):
                raise ValueError(f"identical completions of prompt {s.prompt_index} have different advantages")
            for j in range(len(completion)):
                weight[first + j] += 1.0
            continue
        scored[(r, tuple(completion))] = len(token)
        for j, (t, lp) in enumerate(zip(completion, s.logprobs, strict=True)):
            row.append(r)
            pos.append(len(prompt) - 1 + j)
            token.append(t)
            weight.append(1.0)
            advantage.append(float(a))
            engine_logp.append(lp)
    width = max(len(x) for x in inputs)
    ids = torch.full((len(inputs), width), pad, dtype=torch.long)
    for r, x in enumerate(inputs):
        ids[r, :len(x)] = torch.tensor(x)
    return RolloutTensors(ids, torch.tensor(row, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                          torch.tensor(token, dtype=torch.long), torch.tensor(weight), torch.tensor(advantage),
                          torch.tensor(engine_logp, dtype=torch.float32))


def scored_logprobs(logits: torch.Tensor, batch: RolloutTensors, temperature: float = 1.0) -> torch.Tensor:
    """logits [R, T, V] of `batch.ids` -> the logprob of each scored token [N] at `temperature`."""
    picked = logits[batch.row, batch.pos].float() / temperature  # [N, V]
    return torch.log_softmax(picked, dim=-1).gather(-1, batch.token[:, None]).squeeze(-1)
