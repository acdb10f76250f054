import pytest

from deltamoe.errors import ConfigError
from deltamoe.train.config import TrainConfig, parse_profile_steps, resolve_config


def test_file_then_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[optim]\nlr = 0.01\ngrad_accum = 2\n[data]\ntask = "arithmetic"\nbatch_size = 8\n'
                    '[model.overrides]\nhidden_size = 64\n')
    cfg = resolve_config(toml, {"optim.lr": 0.5, "run.steps": 7})
    assert (cfg.optim.lr, cfg.optim.grad_accum, cfg.data.task, cfg.run.steps) == (0.5, 2, "arithmetic", 7)
    assert cfg.model.overrides == {"hidden_size": 64} and cfg.micro_batch_size == 4
    yml = tmp_path / "run.yaml"
    yml.write_text("run:\n  seed: 3\nparallel:\n  dp: 2\n")
    cfg = resolve_config(yml)
    assert cfg.run.seed == 3 and cfg.parallel.dp == 2 and cfg.micro_batch_size == 16


@pytest.mark.parametrize("change, field", [
    ({"optim.lr": 0}, "optim.lr"), ({"run.steps": 0}, "run.steps"), ({"data.task": "sorting"}, "data.task"),
    ({"data.batch_size": 6, "optim.grad_accum": 4}, "data.batch_size"), ({"run.precision": "fp8"}, "run.precision"),
    ({"parallel.schedule": "zb"}, "parallel.schedule"), ({"optim.warmup": 3}, "optim.warmup"),
    ({"training.lr": 1}, "training"), ({"run.profile_steps": "5:2"}, "run.profile_steps"),
    ({"data.num_queries": 9}, "data.num_queries"), ({"balance.gamma": -1.0}, "balance.gamma"),
])
def test_bad_values_name_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict(change).validate()
    assert e.value.field == field


def test_profile_steps_and_bad_files(tmp_path):
    assert parse_profile_steps("3:5") == (3, 5)
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\n")
    with pytest.raises(ConfigError, match="bad.toml cannot be parsed"):
        resolve_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(tmp_path / "missing.toml")


@pytest.mark.parametrize("section, value, field, needle", [
    ("run", {"resume": "no"}, "run.resume", "expected true or false, got 'no'"),
    ("run", {"progress": "no"}, "run.progress", "expected true or false"),
    ("run", {"resume_from": 5}, "run.resume_from", "expected None or a non-empty string, got 5"),
    ("data", {"path": 5}, "data.path", "expected None or a non-empty string"),
    ("model", {"path": 5}, "model.path", "expected None or a non-empty string"),
    ("run", {"out": 5}, "run.out", "expected a folder path, got 5"),
    ("run", {"seed": "1"}, "run.seed", "expected an integer"),
])
def test_run_file_values_of_the_wrong_type_name_the_field(section, value, field, needle):
    """A run file's strings are not booleans (resume = "no" resumed) and numbers are not paths
    (they failed with a traceback deep in the run)."""
    from deltamoe.train.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({section: value}).validate(world_size=1)
    assert e.value.field == field and needle in str(e.value)


def test_a_section_that_is_not_a_table_says_so():
    from deltamoe.train.config import TrainConfig

    with pytest.raises(ConfigError, match="expected a table of optim fields, got 5") as e:
        TrainConfig.from_dict({"optim": 5})
    assert e.value.field == "optim"
