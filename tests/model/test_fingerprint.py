"""The weights fingerprint P/D servers compare: equal for the same weights wherever they lie, different
for other weights, another dtype or a preset with another seed."""

import shutil

import pytest

from deltamoe.errors import CheckpointError
from deltamoe.model.fingerprint import weights_fingerprint
from deltamoe.model.load import build_model
from deltamoe.model.weights import save_checkpoint


def test_fingerprint_follows_the_weights_not_the_folder(tmp_path, configs):
    cfg = configs["k3.1"]()
    save_checkpoint(build_model(cfg, seed=3), tmp_path / "a", max_shard_bytes=200_000)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    save_checkpoint(build_model(cfg, seed=4), tmp_path / "b", max_shard_bytes=200_000)
    a = weights_fingerprint(tmp_path / "a", "float32")
    assert len(a) == 16 and a == weights_fingerprint(str(tmp_path / "copy"), "float32")
    assert a != weights_fingerprint(tmp_path / "b", "float32")  # same names, shapes and sizes
    assert a != weights_fingerprint(tmp_path / "a", "bfloat16")


def test_fingerprint_sees_one_changed_tensor(tmp_path, configs):
    """A fine-tune that changed a single (large) tensor: a sample lands in it."""
    cfg = configs["k3.1"]()
    model = build_model(cfg, seed=3)
    save_checkpoint(model, tmp_path / "a")
    model.lm_head.weight.data.add_(1e-3)
    save_checkpoint(model, tmp_path / "b")
    assert weights_fingerprint(tmp_path / "a", "float32") != weights_fingerprint(tmp_path / "b", "float32")


def test_fingerprint_of_presets_and_bad_folders(tmp_path):
    assert weights_fingerprint("tiny", "float32") == weights_fingerprint("tiny", "float32")
    assert weights_fingerprint("tiny", "float32") != weights_fingerprint("tiny", "float32", seed=1)
    assert weights_fingerprint("tiny", "float32") != weights_fingerprint("small", "float32")
    with pytest.raises(CheckpointError):
        weights_fingerprint(tmp_path, "float32")  # a folder without weights
