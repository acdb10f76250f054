"""Every loader turns malformed input into one DeltaMoEError naming the file or field, never
another exception: property tests feed random JSON, mutated valid files, random bytes and odd
paths to each of them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltamoe.config import load_preset
from deltamoe.errors import DeltaMoEError
from deltamoe.hf_config import config_to_hf, load_config
from deltamoe.model.weights import INDEX_FILE, checkpoint_files
from deltamoe.train.checkpoint import read_saved_config, read_train_state
from deltamoe.train.config import resolve_config
from deltamoe.train.manifest import MANIFEST, read_manifest
from deltamoe.train.safe_dcp import read_dcp_metadata

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8)


def _mutate(draw, base: dict, nested: tuple[str, ...] = ()) -> dict:
    """`base` with one to three fields (top level, or inside one of the `nested` tables) replaced by random JSON."""
    data = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        table = data
        inner = [k for k in nested if isinstance(data.get(k), dict) and data[k]]
        if inner and draw(st.booleans()):
            table = data[draw(st.sampled_from(inner))]
        table[draw(st.sampled_from(sorted(table)))] = draw(json_values)
    return data


@st.composite
def model_configs(draw):
    tiny = load_preset("tiny")
    base = draw(st.sampled_from([config_to_hf(tiny), tiny.to_dict()]))
    return _mutate(draw, base, ("linear_attn_config", "text_config"))


@st.composite
def indexes(draw):
    names = draw(st.lists(st.sampled_from(["a.safetensors", "../../elsewhere/model.safetensors", "/etc/passwd",
                                           "..", "", "sub/b.safetensors", "c\\d.safetensors"]), min_size=1))
    base = {"metadata": {"total_size": 1}, "weight_map": {f"t{i}": n for i, n in enumerate(names)}}
    return _mutate(draw, base, ("weight_map",)) if draw(st.booleans()) else base


@st.composite
def train_configs(draw):
    base = {"model": {"preset": "tiny"}, "data": {"task": "recall", "batch_size": 8},
            "optim": {"lr": 1e-3}, "run": {"steps": 4, "profile_steps": "1:2"}, "parallel": {"tp": 1}}
    return _mutate(draw, base, ("model", "data", "optim", "run", "parallel"))


def _expect_clean(fn, *args):
    """`fn(*args)` either returns or raises a DeltaMoEError; anything else fails the test."""
    try:
        fn(*args)
    except DeltaMoEError as e:
        assert "Traceback" not in e.one_line()


def _write(path: Path, content) -> None:
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())


contents = st.one_of(json_values, st.binary(max_size=64))


@EXAMPLES
@given(st.one_of(contents, model_configs()))
def test_model_config_loader(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("cfg")
    _write(folder / "config.json", content)
    _expect_clean(load_config, folder)
    _expect_clean(load_config, folder / "config.json")


@EXAMPLES
@given(st.one_of(contents, indexes()))
def test_safetensors_index_loader(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("idx")
    (folder / "a.safetensors").write_bytes(b"not a safetensors file")
    _write(folder / INDEX_FILE, content)
    _expect_clean(checkpoint_files, folder)


@EXAMPLES
@given(st.one_of(contents, train_configs()))
def test_training_run_file_loader(tmp_path_factory, content):
    file = tmp_path_factory.mktemp("run") / "run.json"
    _write(file, content)
    _expect_clean(resolve_config, file)


@EXAMPLES
@given(contents)
def test_checkpoint_side_files(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("ck")
    for name in ("train_state.rank0.json", MANIFEST, "train_config.json"):
        _write(folder / name, content)
    _expect_clean(read_train_state, folder / "train_state.rank0.json")
    _expect_clean(read_manifest, folder)
    _expect_clean(read_saved_config, folder)


@EXAMPLES
@given(st.one_of(st.binary(max_size=64), json_values.map(pickle.dumps)))
def test_dcp_index_loader(tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("dcp")
    (folder / ".metadata").write_bytes(content)
    _expect_clean(read_dcp_metadata, folder)


def _odd_paths(tmp_path: Path) -> list[Path]:
    """A folder where a file belongs, a file where a folder belongs, a missing path, a /proc path."""
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "file").write_text("x")
    return [tmp_path / "dir.json", tmp_path / "file", tmp_path / "missing", Path("/proc/self/nope")]


@pytest.mark.parametrize("loader", [load_config, checkpoint_files, read_train_state, read_manifest,
                                    read_saved_config, read_dcp_metadata, resolve_config])
def test_loaders_on_odd_paths(tmp_path, loader):
    for path in _odd_paths(tmp_path):
        _expect_clean(loader, path)
    # A folder where the loader expects its file inside to be one.
    for name in ("config.json", INDEX_FILE, MANIFEST, ".metadata", "train_config.json"):
        (tmp_path / "inner" / name).mkdir(parents=True, exist_ok=True)
    _expect_clean(loader, tmp_path / "inner")
