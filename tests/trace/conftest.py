"""Shared synthetic jobs: generated once per test session (a few hundred ms each)."""

from __future__ import annotations

import pytest

from deltamoe.trace.synth import SynthConfig, generate


def make_job(tmp_path_factory, name: str, **kw) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp(name)
    truth = generate(SynthConfig(**kw), out)
    return str(out), truth


@pytest.fixture(scope="session")
def pipeline_job(tmp_path_factory):
    """16 ranks, 4 stages x 4 replicas, straggler in stage 1 (not the last stage)."""
    return make_job(tmp_path_factory, "pipe", ranks=16, steps=3, pp=4, stragglers=(5,), slowdown=1.3)


@pytest.fixture(scope="session")
def clean_pipeline_job(tmp_path_factory):
    return make_job(tmp_path_factory, "clean", ranks=16, steps=3, pp=4, microbatches=8)


@pytest.fixture(scope="session")
def dp_job(tmp_path_factory):
    """No pipeline, two stragglers in different EP groups, legacy NCCL names, gzip, compact."""
    return make_job(tmp_path_factory, "dp", ranks=16, steps=3, stragglers=(3, 12), slowdown=1.2,
                    nccl_names="legacy", gz=True, compact=True)
