"""The issue's reproductions through the real entry point: each is one `error:` line on stderr and
exit code 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from deltamoe.cli import main
from deltamoe.config import load_preset
from deltamoe.hf_config import config_to_hf
from deltamoe.train import checkpoint
from deltamoe.train.manifest import write_manifest

MICRO_FLAGS = ["--preset", "tiny", "--steps", "3", "--batch-size", "2", "--no-progress"]


def _one_error_line(argv, capfd, *expect: str) -> str:
    """Exit 2 and one error line (a resume notice before it is allowed: it is not an error)."""
    assert main([str(a) for a in argv]) == 2
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("resuming ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for text in expect:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("content, expect", [
    (b"[1, 2, 3]", "expected a JSON object, got list"), (b"42", "got int"), (b"null", "got NoneType"),
    (b"\xff\xfe{}", "is not valid JSON"), (b"{", "is not valid JSON"),
    (b'{"model_type": "kimi_linear", "architectures": [], "num_hidden_layers": 2, "linear_attn_config": [1]}',
     "linear_attn_config: expected an object, got list"),
])
def test_malformed_config_json(tmp_path, capfd, content, expect):
    (tmp_path / "config.json").write_bytes(content)
    _one_error_line(["info", tmp_path], capfd, expect)


@pytest.mark.parametrize("content", [{"num_hidden_layers": 10**9},
                                     {"model_type": "kimi_linear", "architectures": ["x"], "num_hidden_layers": 10**9}])
def test_absurd_layer_count_is_refused_before_building_lists(tmp_path, capfd, content):
    (tmp_path / "config.json").write_text(json.dumps(content))
    _one_error_line(["info", tmp_path], capfd, "num_hidden_layers: expected at most 4096 layers")


def test_config_json_that_is_a_folder(tmp_path, capfd):
    (tmp_path / "config.json").mkdir()
    _one_error_line(["info", tmp_path], capfd, "cannot read", "config.json")


@pytest.mark.parametrize("weight_map, expect", [
    ([["a", "b"]], "expected weight_map to be an object"),
    ({"model.embed_tokens.weight": "../../elsewhere/model.safetensors"}, "outside the checkpoint folder"),
    ({"model.embed_tokens.weight": "/etc/hostname"}, "outside the checkpoint folder"),
])
def test_malformed_or_escaping_index(tmp_path, capfd, weight_map, expect):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(load_preset("tiny"))))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _one_error_line(["generate", tmp_path, "--prompt", "hi", "--max-tokens", "1"], capfd, expect)


def test_escaping_shard_is_never_opened(tmp_path, monkeypatch):
    """The index is refused before any shard outside the folder is touched."""
    from deltamoe.errors import CheckpointError
    from deltamoe.model import weights

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"x")
    ck = tmp_path / "a" / "b"
    ck.mkdir(parents=True)
    (ck / weights.INDEX_FILE).write_text(json.dumps({"weight_map": {"t": "../../elsewhere/model.safetensors"}}))
    opened = []
    monkeypatch.setattr(weights, "safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        weights.checkpoint_files(ck)
    assert opened == []


def _a_file(path):
    path.write_text("a file")
    return path


@pytest.mark.parametrize("make_out, expect", [
    (lambda p: _a_file(p / "out"), "exists and is not a folder"),
    (lambda p: "/proc/deltamoe-run", "cannot write into /proc/deltamoe-run"),
    (lambda p: _a_file(p / "file") / "run", "Not a directory"),
])
def test_unusable_output_folder(tmp_path, capfd, make_out, expect):
    out = make_out(tmp_path)
    _one_error_line(["train", *MICRO_FLAGS, "--out", out], capfd, "run.out", expect)


@pytest.mark.parametrize("make_out, expect", [
    (lambda p: _a_file(p / "out"), "exists and is not a folder"),
    (lambda p: "/proc/deltamoe-demo", "cannot write into /proc/deltamoe-demo"),
])
def test_unusable_demo_folder(tmp_path, capfd, make_out, expect):
    _one_error_line(["demo", "--out", str(make_out(tmp_path))], capfd, "--out", expect)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through permissions")
def test_unwritable_output_folder(tmp_path, capfd):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        _one_error_line(["train", *MICRO_FLAGS, "--out", out], capfd, "run.out", "cannot write into")
    finally:
        out.chmod(0o700)


@pytest.mark.parametrize("target", ["/proc/deltamoe-traces", "FILE", "FILE/sub"])
def test_unwritable_trace_synth_folder(tmp_path, capfd, target):
    (tmp_path / "file").write_text("x")
    path = target.replace("FILE", str(tmp_path / "file"))
    _one_error_line(["trace", "synth", path, "--ranks", "2"], capfd, "OUT")


@pytest.mark.parametrize("option", ["--html", "--json"])
@pytest.mark.parametrize("target", ["/proc/deltamoe/report", "FOLDER", "FILE/report"])
def test_unwritable_trace_report(tmp_path, capfd, option, target):
    (tmp_path / "traces").mkdir()
    (tmp_path / "file").write_text("x")
    path = target.replace("FOLDER", str(tmp_path)).replace("FILE", str(tmp_path / "file"))
    _one_error_line(["trace", "analyze", tmp_path / "traces", option, path, "--quiet"], capfd, option)


@pytest.fixture
def resumable(trained_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained_run, out)
    return out, checkpoint.latest_checkpoint(out)


def _resume_argv(out):
    # The same run as tests/security/conftest.py's, one step further.
    from tests.train.conftest import micro_config

    return ["train", "--config", _run_file(out, micro_config(out, **{"run.steps": 3, "data.batch_size": 2,
                                                                   "data.eval_rows": 2})), "--resume"]


def _run_file(out, cfg):
    file = out.parent / "run.json"
    data = cfg.to_dict()
    data["parallel"] = {}
    file.write_text(json.dumps(data))
    return file


@pytest.mark.parametrize("name, content, expect", [
    ("train_state.rank0.json", b"garbage", "train_state.rank0.json cannot be read"),
    ("train_state.rank0.json", b'{"step": -1}', "is not a train state"),
    (".metadata", b"garbage", "is not a DCP checkpoint index"),
    (".metadata", b"", "is not a DCP checkpoint index"),
])
def test_garbage_checkpoint_files_on_resume(resumable, capfd, name, content, expect):
    out, ck = resumable
    (ck / name).write_bytes(content)
    write_manifest(ck)
    _one_error_line(_resume_argv(out), capfd, expect)


def test_resume_with_a_corrupt_shard(resumable, capfd):
    out, ck = resumable
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100:108] = bytes(b ^ 0xFF for b in data[100:108])
    shard.write_bytes(bytes(data))
    _one_error_line(_resume_argv(out), capfd, "__0_0.distcp does not match its checksum")


@pytest.mark.parametrize("damage", ["offsets", "sizes"])
def test_index_that_unpickles_but_lies_is_one_line(resumable, capfd, damage):
    """A well-formed index whose entries point at the wrong bytes or claim other shapes."""
    import pickle

    from deltamoe.train.safe_dcp import read_dcp_metadata

    out, ck = resumable
    meta = read_dcp_metadata(ck)
    if damage == "offsets":
        for info in meta.storage_data.values():
            info.offset += 7
    else:
        import torch

        for entry in meta.state_dict_metadata.values():
            if hasattr(entry, "size"):
                entry.size = torch.Size([3] + list(entry.size)[1:])
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    write_manifest(ck)
    line = _one_error_line(_resume_argv(out), capfd, str(ck))
    assert ("cannot be loaded" in line or "does not match this model" in line) and len(line) < 600
