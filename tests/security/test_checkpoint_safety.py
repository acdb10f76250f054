"""Crafted or damaged training checkpoints are refused by name before anything runs or loads."""

from __future__ import annotations

import io
import json
import os
import pickle

import pytest

from deltamoe.errors import CheckpointError
from deltamoe.train import checkpoint
from deltamoe.train.manifest import MANIFEST, write_manifest
from deltamoe.train.safe_dcp import read_dcp_metadata
from tests.train.conftest import micro_config


class _Payload:
    """Unpickling this creates the file named in it (the reproduction from the issue)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _resume(out, **kw):
    from deltamoe.train.trainer import train

    return train(micro_config(out, **{"run.steps": 3, "data.batch_size": 2, "data.eval_rows": 2,
                                      "run.resume": True, **kw}))


def _ckpt(out):
    return checkpoint.latest_checkpoint(out)


def test_checkpoint_has_a_manifest_of_every_file(trained_run):
    ck = _ckpt(trained_run)
    files = json.loads((ck / MANIFEST).read_text())["files"]
    assert set(files) == {p.name for p in ck.iterdir()} - {MANIFEST}
    assert {".metadata", "__0_0.distcp", "train_state.rank0.json", "train_config.json"} <= set(files)
    assert all(len(v["sha256"]) == 64 and v["bytes"] > 0 for v in files.values())


@pytest.mark.parametrize("where", ["metadata", "bytes_entry"])
def test_planted_pickle_payload_is_refused_and_nothing_runs(run_copy, tmp_path, where):
    ck = _ckpt(run_copy)
    marker = tmp_path / "pwned"
    if where == "metadata":  # the whole index replaced by a payload
        (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        expect = "refused global posix.system"
    else:  # a payload inside an index that is otherwise genuine
        meta = read_dcp_metadata(ck)
        meta.planner_data = _Payload(marker)
        (ck / ".metadata").write_bytes(pickle.dumps(meta))
        expect = "refused global"
    write_manifest(ck)  # an attacker rewrites the manifest too: the unpickler alone must stop it
    with pytest.raises(CheckpointError, match=expect) as e:
        _resume(run_copy)
    assert ".metadata" in str(e.value)
    assert not marker.exists()


def test_payload_in_a_non_tensor_entry_is_refused(run_copy, tmp_path):
    """Optimizer hyperparameters are pickled into the .distcp shard; DCP would read them with
    torch.load(weights_only=False)."""
    import torch

    ck = _ckpt(run_copy)
    meta = read_dcp_metadata(ck)
    marker = tmp_path / "pwned"
    # Rewrite one byte entry's slice of the shard with a torch.save of the payload, at the end of the file.
    info = next(v for k, v in meta.storage_data.items() if k.fqn.endswith("weight_decay"))
    shard = ck / info.relative_path
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    data = shard.read_bytes()
    info.offset, info.length = len(data), len(buf.getvalue())
    shard.write_bytes(data + buf.getvalue())
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(ck)
    with pytest.raises(CheckpointError, match="not plain data"):
        _resume(run_copy)
    assert not marker.exists()


def test_shard_outside_the_checkpoint_folder_is_refused(run_copy):
    ck = _ckpt(run_copy)
    meta = read_dcp_metadata(ck)
    for info in meta.storage_data.values():
        info.relative_path = "../../elsewhere/__0_0.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(ck)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        _resume(run_copy)


def test_corrupt_shard_is_refused_naming_the_file(run_copy):
    ck = _ckpt(run_copy)
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:1000 + 4096] = os.urandom(4096)  # the reproduction: 4 KiB of noise in a shard
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum") as e:
        _resume(run_copy)
    # The message names the file, the field the setting that chose the checkpoint (--resume).
    assert str(shard) in str(e.value) and e.value.field == "run.resume"


@pytest.mark.parametrize("damage", ["truncate", "delete", "extra", "no_manifest", "garbage_manifest"])
def test_damaged_checkpoint_is_refused(run_copy, damage):
    ck = _ckpt(run_copy)
    if damage == "truncate":
        (ck / "__0_0.distcp").write_bytes((ck / "__0_0.distcp").read_bytes()[:100])
        match = "has 100 bytes"
    elif damage == "delete":
        (ck / "train_state.rank0.json").unlink()
        match = "listed in the manifest but missing"
    elif damage == "extra":
        (ck / "__1_0.distcp").write_bytes(b"x")
        match = "not listed in the manifest"
    elif damage == "no_manifest":
        (ck / MANIFEST).unlink()
        match = "no manifest.json"
    else:
        (ck / MANIFEST).write_text("[1, 2]")
        match = "not a format-1 manifest"
    with pytest.raises(CheckpointError, match=match):
        _resume(run_copy)


GARBAGE_METADATA = [b"", b"garbage", b"\x80\x04K\x01.", pickle.dumps({"a": 1}), b"\x80\x05\x95"]
GARBAGE_STATE = [b"garbage", b"[1, 2]", b"null", b'{"step": "x"}',
                 b'{"step": 1, "data_position": 2, "tokens": 3, "rng": {"cpu": "!!"}}',
                 b'{"step": 1, "data_position": 2, "tokens": 3, "rng": {"cpu": "AAAA"}}']


@pytest.mark.parametrize("name, content, match",
                         [(".metadata", c, "is not a DCP checkpoint index") for c in GARBAGE_METADATA]
                         + [("train_state.rank0.json", c, "train_state.rank0.json") for c in GARBAGE_STATE])
def test_garbage_checkpoint_file_is_one_clear_error(run_copy, name, content, match):
    ck = _ckpt(run_copy)
    (ck / name).write_bytes(content)
    write_manifest(ck)  # consistent with the garbage: the reader itself must refuse it
    with pytest.raises(CheckpointError, match=match):
        _resume(run_copy)


def test_export_reader_checks_the_checkpoint_too(run_copy, tmp_path):
    from deltamoe.model.load import build_model

    ck = _ckpt(run_copy)
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(ck)
    model = build_model(_model_config())
    with pytest.raises(CheckpointError, match="refused global"):
        checkpoint.load_model_weights(ck, model)
    assert not marker.exists()


def _model_config():
    from deltamoe.train.model_setup import resolve_model_config

    return resolve_model_config(micro_config("unused").model)
