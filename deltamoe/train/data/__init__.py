"""Training data: built-in synthetic tasks (tasks.py, task_stream.py) and text/jsonl corpora
(text.py), both served as random-access rows (rows.py). `build_data` picks one from the config."""

from __future__ import annotations

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.train.config import TrainConfig
from deltamoe.train.data.rows import DataSource, Rows
from deltamoe.train.data.task_stream import TaskStream
from deltamoe.train.data.tasks import make_task
from deltamoe.train.data.text import TextSource
from deltamoe.train.data.tokenizer import data_tokenizer

__all__ = ["DataSource", "Rows", "build_data"]


def special_ids(config: ModelConfig) -> tuple[int, int, int]:
    """(bos, eos, pad): the model's, or the byte tokenizer's when the config leaves one unset."""
    bos = 256 if config.bos_token_id is None else config.bos_token_id
    eos = 257 if config.eos_token_id is None else config.eos_token_id
    pad = 258 if config.pad_token_id is None else config.pad_token_id
    if max(bos, eos, pad) >= config.vocab_size:
        raise ConfigError(f"special token ids ({bos}, {eos}, {pad}) must be below vocab_size ({config.vocab_size})",
                          field="model")
    return bos, eos, pad


def build_data(cfg: TrainConfig, model_config: ModelConfig) -> DataSource:
    d = cfg.data
    bos, eos, pad = special_ids(model_config)
    if d.path is not None:
        tok = data_tokenizer(cfg.model.path, model_config)
        return TextSource(d.path, tok, d.seq_len, cfg.run.seed, d.eval_fraction, d.eval_rows, eos)
    if model_config.vocab_size < 256:
        raise ConfigError(f"synthetic tasks are byte-level and need vocab_size >= 256, got {model_config.vocab_size}",
                          field="model")
    try:
        task = make_task(d.task, digits=d.digits, num_pairs=d.num_pairs, num_queries=d.num_queries,
                         context_len=d.context_len, string_len=d.string_len)
    except ValueError as e:
        raise ConfigError(str(e).split(": ", 1)[-1], field=f"data.{str(e).split(':')[0]}") from None
    # The eval stream differs from training in its seed stream *and* its hash bucket (tasks.py).
    return TaskStream(task, d.seq_len, cfg.run.seed, d.eval_rows, bos=bos, eos=eos, pad=pad)
