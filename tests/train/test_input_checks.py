"""Input a run cannot train on is refused up front: one line naming the field, exit 2, nothing written,
no process group. Also the run's closing lines (summary, plain progress) and the data files' encoding."""

from __future__ import annotations

import json
import warnings

import pytest

from deltamoe.errors import ConfigError
from deltamoe.train.data.text import read_documents


def refused(tmp_path, capsys, *args: str) -> str:
    """The one error line of `deltamoe train ARGS`, after checking exit 2 and that --out was not created."""
    from deltamoe.cli import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--task", "recall", "--steps", "1", "--batch-size", "8", *args,
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("args, rows", [(["--pp", "2", "--microbatches", "3"], 8),
                                        (["--dp", "2", "--microbatches", "3"], 4),
                                        (["--pp", "2", "--microbatches", "16"], 8)])
def test_microbatches_that_do_not_divide_the_local_batch_are_refused(tmp_path, capsys, monkeypatch, args, rows):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun --nproc-per-node 2
    line = refused(tmp_path, capsys, *args)
    assert line.startswith(f"error: parallel.microbatches: expected a divisor of the {rows} rows each data rank")
    assert "--microbatches" in line


def test_a_pipeline_needs_at_least_pp_microbatches(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(tmp_path, capsys, "--pp", "2")
    assert line.startswith("error: parallel.microbatches: expected at least pp (2) microbatches for a pipeline, got 1")
    assert "--microbatches 2" in line


def test_layout_errors_against_the_model_name_the_parallel_field(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert refused(tmp_path, capsys, "--ep", "3", "--dp", "2").startswith(
        "error: parallel.ep: expected a divisor of num_experts (16), got 3")


def test_more_pipeline_stages_than_ranks_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = refused(tmp_path, capsys, "--pp", "16", "--microbatches", "16")
    assert line.startswith("error: parallel.pp: tp * pp = 1 * 16 = 16 ranks are needed for one model copy")
    assert "the world has 2" in line and "cannot infer dp" not in line


def test_seq_len_beyond_the_models_positions_is_refused(tmp_path, capsys):
    line = refused(tmp_path, capsys, "--seq-len", "5000")
    assert line.startswith("error: data.seq_len: expected at most the model's max_position_embeddings (4096), "
                           "got 5000")


# ----------------------------------------------------------------- data files


def test_non_utf8_files_are_refused_with_line_and_offset(tmp_path):
    jl = tmp_path / "docs.jsonl"
    jl.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=r"docs.jsonl:2 is not valid UTF-8 \(byte 0xe9 at offset 28\)") as e:
        read_documents(jl)
    assert e.value.field == "data.path"
    txt = tmp_path / "plain.txt"  # was read with errors="replace": trained on U+FFFD
    txt.write_bytes(b"line one\nline two \xff\n")
    with pytest.raises(ConfigError, match=r"plain.txt:2 is not valid UTF-8 \(byte 0xff at offset 18\)"):
        read_documents(txt)


def test_a_utf8_bom_is_dropped(tmp_path):
    jl = tmp_path / "bom.jsonl"
    jl.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b\xe2\x80\xa8c"}\n')  # U+2028 inside a JSON string
    assert read_documents(jl) == ["a", "b\u2028c"]
    txt = tmp_path / "bom.txt"
    txt.write_bytes(b"\xef\xbb\xbfhello")
    assert read_documents(txt) == ["hello"]


def test_a_folder_and_a_json_error_say_what_and_where(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; expected a .txt or .jsonl file"):
        read_documents(tmp_path)
    jl = tmp_path / "bad.jsonl"
    jl.write_text('{"text": "a\tb"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:1 is not valid JSON \(Invalid control character at: column 12\)"):
        read_documents(jl)


# ------------------------------------------------------- the run's closing lines


def test_a_run_without_evaluation_still_prints_its_summary(tmp_path, capsys):
    from deltamoe.train.run_log import RunLog

    log = RunLog(tmp_path, enabled=True)
    log.start({}, None, total=2, progress=False)
    log.step({"step": 2, "loss": 1.25, "tokens_per_s": 10.0}, write=True)
    log.close()
    log.finish(None, "title", 2, "no held-out rows to evaluate")
    assert capsys.readouterr().err.strip().replace("\n", "") == (
        f"step 2: train loss 1.2500, no held-out rows to evaluate -> {tmp_path}")


def test_plain_progress_ends_with_the_closing_evaluation(capsys):
    from deltamoe.train.progress import RunProgress

    progress = RunProgress(total=2, start=0, enabled=True)  # stderr is captured: not a terminal, plain lines
    progress.evaluated({"loss": 2.0, "accuracy": 0.25})
    progress.update(2, {"loss": 1.5, "tokens_per_s": 100.0})
    progress.evaluated({"loss": 1.0, "accuracy": 0.5})  # the closing evaluation of step 2
    progress.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["train 2/2 loss 1.5000  100 tok/s  eval 1.0000 acc 50.0%"]


def test_a_profile_window_from_step_1_warns_nothing(tmp_path):
    from deltamoe.train.profiling import StepProfiler

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiler = StepProfiler((1, 2), 1, tmp_path, 0)  # no room for a warmup step before step 1
        profiler.step()
        profiler.close()
    assert not [w for w in caught if "warmup" in str(w.message)]
    assert json.loads((tmp_path / "traces" / "rank0.json").read_text())["profiler_step_offset"] == 1
