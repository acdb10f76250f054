"""The thread policy every computing command uses (`deltamoe.threads`)."""

from __future__ import annotations

import os

import pytest

from deltamoe.errors import ConfigError
from deltamoe.threads import available_cores, cgroup_cpu_limit, choose_threads


def test_default_uses_the_idle_cores_and_never_more_than_there_are():
    assert choose_threads(env={}, cores=8, busy=0) == 8
    assert choose_threads(env={}, cores=8, busy=3) == 5
    assert choose_threads(env={}, cores=2, busy=1) == 1  # the busy two-core machine: one thread
    assert choose_threads(env={}, cores=2, busy=7) == 1  # overloaded: still one, never zero
    for cores in range(1, 17):
        for busy in range(0, 20):
            assert 1 <= choose_threads(env={}, cores=cores, busy=busy) <= cores


def test_reserve_and_local_ranks_share_the_cores():
    assert choose_threads(env={}, cores=8, busy=0, reserve=1) == 7  # serve keeps a core for its front end
    assert choose_threads(env={}, cores=1, busy=0, reserve=1) == 1
    assert choose_threads(env={"LOCAL_WORLD_SIZE": "4"}, cores=8, busy=0) == 2  # torchrun: 4 ranks on 8 cores
    assert choose_threads(env={"LOCAL_WORLD_SIZE": "4"}, cores=2, busy=0) == 1


def test_omp_num_threads_and_the_flag_win():
    assert choose_threads(env={"OMP_NUM_THREADS": "3"}, cores=2, busy=2) == 3  # the user's setting stands
    assert choose_threads(5, env={"OMP_NUM_THREADS": "3"}, cores=2, busy=0) == 5  # --threads beats the variable
    assert choose_threads(env={"OMP_NUM_THREADS": ""}, cores=4, busy=0) == 4  # empty: unset
    with pytest.raises(ConfigError, match="positive integer") as e:
        choose_threads(env={"OMP_NUM_THREADS": "many"}, cores=4, busy=0)
    assert e.value.field == "OMP_NUM_THREADS"
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="threads"):
            choose_threads(bad, env={})


def test_real_machine_counts(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cores = available_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert 1 <= choose_threads() <= cores


def test_cgroup_quota_caps_the_cores(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    assert available_cores(tmp_path) <= 2  # 1.5 cores of quota: two threads at most
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 1.0 and available_cores(v1) == 1
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(v1) is None
