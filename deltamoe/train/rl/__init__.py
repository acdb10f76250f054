"""RL post-training (GRPO) with the serving engine as the rollout worker and live weight sync."""
