"""One small trained run shared by the checkpoint tests; each test works on its own copy."""

from __future__ import annotations

import shutil

import pytest

from tests.train.conftest import micro_config


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A 2-step micro run with one checkpoint (step 2); treat as read-only."""
    from deltamoe.train.trainer import train

    out = tmp_path_factory.mktemp("secure") / "run"
    train(micro_config(out, **{"run.steps": 2, "data.batch_size": 2, "data.eval_rows": 2}))
    return out


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A fresh copy of `trained_run` that a test may damage."""
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    return out
