"""`deltamoe bench`: listing, one cheap suite end to end, and the README table generated from the results."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deltamoe.benchmarks.suites import bench_dir, discover, select
from deltamoe.benchmarks.table import END, FORMATTERS, START, render_table, results_files, split_readme, times, update_readme
from deltamoe.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
RESULTS = BENCH / "results"
README = REPO_ROOT / "README.md"


def deltamoe(*args: str, cwd: Path = REPO_ROOT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltamoe", *args], capture_output=True, text=True, cwd=cwd, **kw)


def test_list_names_every_suite_with_its_whole_first_sentence():
    out = deltamoe("bench", "--list")
    assert out.returncode == 0, out.stderr
    for name in ("kda", "model_forward", "moe", "plan_validate", "serve_offline", "serve_dsa_decode",
                 "serve_cache_bytes", "serve_online", "train_throughput", "train_quality", "trace"):
        assert name in out.stdout
    summaries = {s.name: s.summary for s in discover(BENCH)}
    # bench_kda's first sentence runs over three docstring lines; the listing keeps all of it.
    assert summaries["kda"].startswith("KDA prefill: deltamoe `chunk_kda` side by side")
    assert summaries["kda"].endswith("the plain token-by-token recurrence `recurrent_kda`, in one run.")
    assert summaries["train_quality"].endswith("reports steps and wall time on two CPU threads.")
    assert all(s.endswith((".", "!", "?")) for s in summaries.values()), summaries


def test_every_suite_has_a_quick_flag_and_names_resolve():
    suites = discover(bench_dir(BENCH))
    assert all(s.has_quick for s in suites), [s.name for s in suites if not s.has_quick]
    assert [s.name for s in select(suites, ["bench_kda.py", "moe"])] == ["kda", "moe"]
    with pytest.raises(ConfigError, match="unknown suite 'nope'"):
        select(suites, ["nope"])


def test_missing_bench_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path)):
        bench_dir(tmp_path)
    out = deltamoe("bench", "--list", "--bench-dir", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and str(tmp_path / "nowhere") in out.stderr


def test_suites_come_from_the_working_directory_not_the_package_location(tmp_path, monkeypatch):
    """An installed package has no bench/ beside it: the default is bench/ where the command runs."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=str(tmp_path / "bench")) as error:
        bench_dir()
    assert "source checkout" in error.value.hint
    monkeypatch.chdir(REPO_ROOT)
    assert bench_dir() == BENCH
    out = deltamoe("bench", "--list", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert str(tmp_path / "bench") in out.stderr and "--bench-dir" in out.stderr


def test_unknown_suite_exits_2():
    for mode in ([], ["--check"], ["--list"], ["--table-only"]):  # whatever else is asked
        out = deltamoe("bench", "no_such_suite", *mode)
        assert out.returncode == 2 and "no_such_suite" in out.stderr, mode


def test_one_cheap_suite_runs_into_a_temp_results_dir(tmp_path):
    before = {p.name: p.read_bytes() for p in RESULTS.glob("*.json")}
    out = deltamoe("bench", "serve_cache_bytes", "--quick", "--results-dir", str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    written = json.loads((tmp_path / "serve_cache_bytes_quick.json").read_text())
    assert written["variants"]["Kimi K3 (69 KDA + 24 MLA)"]["bytes_per_token"] == 27648
    assert written["target"]["per_token_vs_all_mla"] == [0.2, 0.3]
    assert {p.name: p.read_bytes() for p in RESULTS.glob("*.json")} == before  # committed results untouched


def test_a_crashing_suite_fails_the_run_but_not_the_others(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench_boom.py").write_text('"""Always fails."""\nraise SystemExit(3)\n')
    (bench / "bench_fine.py").write_text('"""Always passes."""\nprint("fine ran")\n')
    out = deltamoe("bench", "--bench-dir", str(bench), "--results-dir", str(tmp_path / "results"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "fine ran" in out.stdout and "failed: boom" in out.stdout


def test_table_shows_the_figures_of_the_results_files():
    """The rendered rows carry the numbers in bench/results (read here from the JSON, so a rerun
    of a suite does not break the test), with every target judged."""
    table = render_table(RESULTS)

    def load(name: str) -> dict:
        return json.loads((RESULTS / f"{name}.json").read_text())

    offline, cache, dsa = load("serve_offline"), load("serve_cache_bytes"), load("serve_dsa_decode")
    expected = [
        f"{offline['tokens_per_s']['deltamoe engine, compiled decode']:,.0f} tok/s",
        f"{offline['tokens_per_s']['deltamoe engine, eager']:,.0f} tok/s",
        f"**{times(offline['speedup_vs_best_transformers'])}**",
        f"{cache['variants']['Kimi K3 (69 KDA + 24 MLA)']['bytes_per_token']:,} B",
        f"{dsa['compiled']['results'][-1]['dense_mla_ms']:,.1f} ms",
        f"{dsa['results'][-1]['dense_mla_ms']:,.1f} ms",
        "12 of 13 rows",
    ]
    for figure in expected:
        assert figure in table, figure
    assert ">= 1.5x (met)" in table and ">= 8x (" in table
    assert len(table.splitlines()) >= 2 + 14


def test_every_committed_result_has_a_formatter_and_quick_runs_are_left_out(tmp_path):
    assert set(results_files(RESULTS)) <= set(FORMATTERS)
    shutil.copy(RESULTS / "model_forward.json", tmp_path / "model_forward.json")
    quick = json.loads((RESULTS / "model_forward.json").read_text()) | {"seq_len": 512, "deltamoe_s": 1.0}
    (tmp_path / "model_forward_quick.json").write_text(json.dumps(quick))
    table = render_table(tmp_path)
    assert "T=2048" in table and "T=512" not in table and len(table.splitlines()) == 3


def test_readme_block_is_the_generated_table():
    text = README.read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    _, block, after = split_readme(text, README)
    assert block == render_table(RESULTS), "README table is stale: run `deltamoe bench --table-only`"
    assert "docs/benchmarks.md" in after  # the hand-written pointer to the notes stays outside the block


def test_table_only_check_passes_on_the_committed_readme():
    out = deltamoe("bench", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_update_readme_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nintro\n\n{START}\nold\n{END}\n\nnotes\n")
    assert update_readme(readme, "| a |\n|---|")
    assert readme.read_text() == f"# x\n\nintro\n\n{START}\n| a |\n|---|\n{END}\n\nnotes\n"
    assert not update_readme(readme, "| a |\n|---|")
    readme.write_text("no markers")
    with pytest.raises(ConfigError, match="bench-table"):
        update_readme(readme, "t")


def test_ratios_never_round_onto_a_whole_number_goal():
    """4.97x beside a missed '>= 5x' must not read 5.0x; far from a whole number one decimal stays."""
    assert times(4.97) == "4.97x" and times(5.02) == "5.02x" and times(5.0) == "5.0x"
    assert times(4.4) == "4.4x" and times(0.94) == "0.94x" and times(22.2) == "22.2x"


def test_serve_disagg_rows_judge_both_goals_and_show_k3_bytes():
    from deltamoe.benchmarks.table import serve_disagg_rows

    run = {"chat_tpot_p99_ms": 40.0, "chat_itl_p99_ms": 90.0}
    d = {"config": {"model": "tiny", "chats": 4, "chat_len": 32, "chat_output": 32, "long_len": 1536, "long_every": 6.0},
         "targets": {"p99_chat_tpot_colocated_over_disagg": 2.0, "handoff_over_raw_tcp": 0.5},
         "colocated": {"chat_tpot_p99_ms": 100.0, "chat_itl_p99_ms": 900.0}, "disaggregated": run,
         "summary": {"p99_chat_tpot_colocated_over_disagg": 2.5, "p99_chat_itl_colocated_over_disagg": 10.0},
         "hand_off": {"idle": [{"bytes_per_handoff": 2**20, "gb_s": 0.9, "raw_tcp_gb_s": 1.5, "over_raw_tcp": 0.6},
                               {"bytes_per_handoff": 2**22, "gb_s": 0.6, "raw_tcp_gb_s": 1.5, "over_raw_tcp": 0.4}]},
         "bytes_per_handoff": [{"model": "kimi-k3 (planner)", "prompt_tokens": 4096, "bytes": 537 * 2**20, "measured": None},
                               {"model": "tiny, this run", "prompt_tokens": 10, "bytes": 2**20, "measured": 2**20}]}
    tpot, handoff, sizes = serve_disagg_rows(d)
    assert tpot[2:] == ["colocated TPOT p99 100 ms, gap p99 900 ms", "**2.5x** / 10.0x", ">= 2x p99 TPOT (met)"]
    assert handoff[1:] == ["0.90 / 0.60 GB/s", "Mooncake raw TCP write 1.50 / 1.50 GB/s", "0.60 / **0.40**",
                           ">= 50 % of raw at every size (missed)"]
    assert "(gather + write + scatter)" in handoff[0]  # a run from before the notice was timed
    for row in d["hand_off"]["idle"]:
        row["copy_seconds"] = 0.001
    assert "(prefill's finish -> cache in the decode server's pools)" in serve_disagg_rows(d)[1][0]
    assert sizes[1] == "537 MiB" and "1.00 MiB measured, 1.00 MiB predicted" in sizes[2]
    # Several in flight: a row of its own, bytes over the seconds with one on its way.
    d["hand_off"]["sustained"] = [{"in_flight": 4, "handoffs": 8, "bytes": 8 * 2**20, "gb_s": 0.3, "raw_tcp_gb_s": 1.5,
                                   "over_raw_tcp": 0.2},
                                  {"in_flight": 4, "handoffs": 8, "bytes": 2**25, "gb_s": 0.9, "raw_tcp_gb_s": 1.5,
                                   "over_raw_tcp": 0.6}]
    tpot, handoff, sustained, sizes = serve_disagg_rows(d)
    assert sustained[0].startswith("same, 4 hand-offs in flight") and "1.00 / 4.00 MiB" in sustained[0]
    assert sustained[1:] == ["0.30 / 0.90 GB/s", "Mooncake raw TCP write 1.50 / 1.50 GB/s", "**0.20** / 0.60",
                             ">= 50 % of raw at every size (missed)"]
    # A run that also timed a raw write with its notice: a row beside the goal's, which stays as it was.
    for row, noticed in zip(d["hand_off"]["idle"], (1.2, 0.8)):
        row["raw_tcp_noticed_gb_s"], row["over_raw_tcp_noticed"] = noticed, row["gb_s"] / noticed
    tpot, handoff, noticed, sustained, sizes = serve_disagg_rows(d)
    assert handoff[3:] == ["0.60 / **0.40**", ">= 50 % of raw at every size (missed)"]
    assert "raw write that also tells its receiver" in noticed[0]
    assert noticed[1:4] == ["0.90 / 0.60 GB/s", "Mooncake raw TCP write + notice 1.20 / 0.80 GB/s", "0.75 / 0.75"]


@pytest.mark.parametrize("one_step, mode", [("eager", "eager, async scheduling"),
                                             ("compiled decode", "compiled decode, multi-step 8")])
def test_offline_async_and_multi_step_modes_are_set_against_their_one_step_modes(one_step, mode):
    offline = json.loads((RESULTS / "serve_offline.json").read_text())
    tps = offline["tokens_per_s"]
    base = tps[f"deltamoe engine, {one_step}"]
    tps[f"deltamoe engine, {mode}"] = base * 1.5
    rows = FORMATTERS["serve_offline"](offline)
    row = next(r for r in rows if r[0] == f"same, deltamoe {mode}")
    assert row[1:4] == [f"{base * 1.5:,.0f} tok/s", f"{one_step}, one step at a time {base:,.0f}", "1.5x"]
    assert rows[0][3] == f"**{times(offline['speedup_vs_best_transformers'])}**"  # the headline is unchanged


def test_a_disagg_run_with_async_scheduling_says_so():
    disagg = json.loads((RESULTS / "serve_disagg.json").read_text())
    assert "async scheduling" not in FORMATTERS["serve_disagg"](disagg)[0][0]
    disagg["config"]["async_scheduling"] = True
    label = FORMATTERS["serve_disagg_async"](disagg)[0][0]
    assert label.endswith("with async scheduling on every server (`python bench/bench_serve_disagg.py "
                          "--async-scheduling`)")
