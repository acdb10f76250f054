"""Training: `train(TrainConfig)` runs the loop (trainer.py) on one process or under torchrun.

One concern per file: config (TrainConfig), data/ (tasks, text), optim (AdamW + schedule),
step (one optimizer step), balance (router biases, balance loss),
evaluate, checkpoint (DCP), metrics (jsonl/JSON), plots, profiling, progress, cli;
rl/ is GRPO post-training with the serving engine as the rollout worker (`deltamoe rl`).
"""
