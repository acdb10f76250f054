"""`deltamoe trace ...` through the top-level CLI entry point."""

from __future__ import annotations

import json

import pytest

from deltamoe.cli import main
from deltamoe.errors import TraceError
from deltamoe.trace.cli import parse_steps


def test_missing_dir_is_exit_2_one_line(tmp_path, capsys):
    assert main(["trace", "analyze", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: DIR: not a directory")


def test_empty_dir_is_exit_2(tmp_path, capsys):
    assert main(["trace", "analyze", str(tmp_path)]) == 2
    assert "no *.json" in capsys.readouterr().err


def test_synth_then_analyze_writes_json_and_html(tmp_path, capsys):
    job = tmp_path / "job"
    assert main(["trace", "synth", str(job), "--ranks", "8", "--steps", "2", "--pp", "2", "--straggler", "1",
                 "--gz", "--workers", "1"]) == 0
    assert len(list(job.glob("rank*.pt.trace.json.gz"))) == 8
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    assert main(["trace", "analyze", str(job), "--json", str(out_json), "--html", str(out_html),
                 "--workers", "1", "--steps", "1:3"]) == 0
    rep = json.loads(out_json.read_text())
    assert [s["rank"] for s in rep["stragglers"]] == [1]
    assert set(rep["bubble_fraction"]) == {"0", "1"}
    assert {"compute_s", "comm_s", "idle_s"} <= set(rep["ranks"][0])
    page = out_html.read_text()
    assert page.count("data:image/png;base64,") >= 5 and "Stragglers" in page
    # Tables a reader can scan: stragglers with evidence, per-rank breakdown, bubbles per stage.
    assert page.count("<table>") >= 4 and "Straggler: rank 1." in page and "Score: the time" in page
    assert "measured bubble" in page and "{'" not in page


def test_bad_options_exit_2(tmp_path, capsys):
    assert main(["trace", "analyze", str(tmp_path), "--steps", "5:2"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["trace", "synth", str(tmp_path / "x"), "--ranks", "6", "--pp", "4"]) == 2
    assert "--pp" in capsys.readouterr().err


def test_parse_steps():
    assert parse_steps("2:5") == (2, 5) and parse_steps("3") == (3, 4)
    assert parse_steps(":4") == (None, 4) and parse_steps("2:") == (2, None) and parse_steps(None) == (None, None)
    with pytest.raises(TraceError):
        parse_steps("a:b")


def test_module_entry_point_maps_errors(tmp_path, capsys):
    from deltamoe.trace.__main__ import main as trace_main

    assert trace_main(["analyze", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: DIR: not a directory")


def test_module_entry_point_takes_the_same_options(tmp_path, capsys):
    """`python -m deltamoe.trace` wraps the Typer commands as click ones: same options, same report."""
    from deltamoe.trace.__main__ import main as trace_main

    job = tmp_path / "job"
    assert trace_main(["synth", str(job), "--ranks", "4", "--steps", "3", "--straggler", "1", "--straggler", "2",
                       "--compact", "--workers", "1"]) == 0
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    opts = ["--workers", "1", "--steps", "1:3", "--comm-pattern", "^xccl", "--comm-pattern", "^yccl", "--quiet"]
    assert trace_main(["analyze", str(job), "--json", str(a), *opts]) == 0
    assert main(["trace", "analyze", str(job), "--json", str(b), *opts]) == 0
    ra, rb = (json.loads(p.read_text()) for p in (a, b))
    for r in (ra, rb):
        r.pop("read_seconds"), r.pop("analysis_seconds")
    assert ra == rb and [s["step"] for s in ra["step_times"]["steps"]] == [1, 2]
    assert trace_main(["analyze", str(job), "--workers", "x"]) == 2
    assert "--workers" in capsys.readouterr().err


def test_one_declaration_serves_both_entry_points(tmp_path, capsys):
    """`deltamoe trace` hands its arguments to the argparse parsers `python -m deltamoe.trace` uses."""
    from deltamoe.trace.command import parser

    ns = parser("analyze").parse_args(["d", "--comm-pattern", "a", "--comm-pattern", "b", "--quiet", "--workers", "3"])
    assert ns.comm_pattern == ["a", "b"] and ns.quiet and ns.workers == 3 and ns.json_out is None
    assert main(["trace", "analyze", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: deltamoe trace analyze") and "--comm-pattern" in out
    assert main(["trace", "synth", str(tmp_path / "x"), "--ranks", "4", "--p2p", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_module_analyze_skips_click(tmp_path):
    """The benchmarked entry point must not pay for click / Typer / multiprocessing at start-up."""
    import subprocess
    import sys

    job = tmp_path / "job"
    from deltamoe.trace.__main__ import main as trace_main

    assert trace_main(["synth", str(job), "--ranks", "2", "--steps", "2", "--compact", "--workers", "1"]) == 0
    code = ("import sys; from deltamoe.trace.__main__ import main; "
            f"rc = main(['analyze', {str(job)!r}, '--quiet', '--workers', '1']); "
            "print(rc, sorted(m for m in ('click', 'typer', 'rich', 'multiprocessing') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[0] == "0 []"



@pytest.mark.parametrize("flags, message", [
    (["--slowdown", "0"], "error: --slowdown: expected a factor > 0"),
    (["--slowdown", "-2"], "error: --slowdown: expected a factor > 0"),
    (["--steps", "0"], "error: --steps: expected >= 1, got 0"),
])
def test_synth_refuses_values_that_would_write_impossible_traces(tmp_path, capsys, flags, message):
    assert main(["trace", "synth", str(tmp_path / "job"), "--ranks", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err


def test_json_dash_writes_the_report_to_stdout_and_the_summary_to_stderr(tmp_path, capsysbinary, monkeypatch):
    job = tmp_path / "job"
    assert main(["trace", "synth", str(job), "--ranks", "4", "--steps", "2", "--straggler", "1", "--workers", "1"]) == 0
    capsysbinary.readouterr()
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "analyze", str(job), "--json", "-", "--workers", "1"]) == 0
    out, err = capsysbinary.readouterr()
    rep = json.loads(out)  # stdout is the report alone
    assert rep["ranks_analyzed"] == 4 and [s["rank"] for s in rep["stragglers"]] == [1]
    assert b"4 of 4 ranks" in err and b"step time p50" in err  # the summary, on stderr
    assert not (tmp_path / "-").exists()
    assert main(["trace", "analyze", str(job), "--json", "-", "--html", "-"]) == 2
    assert b"both write to standard output" in capsysbinary.readouterr().err
