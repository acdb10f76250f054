"""`deltamoe plan` end to end: JSON output, validation, one-line errors with exit code 2."""

import json

import pytest
import typer
from typer.testing import CliRunner

from deltamoe.cli import main
from deltamoe.plan.cli import plan_command

runner = CliRunner()


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(plan_command)
    return app


def test_json_plan_has_costs_layout_estimates_and_recipe():
    res = runner.invoke(_app(), ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4",
                                 "--kv-cache", "fp8", "--slo-tpot", "0.05", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["params"]["total"] == 2_780_110_361_184
    assert doc["weight_bytes"]["total"] == doc["weight_bytes"]["routed_experts"] + sum(
        v for k, v in doc["weight_bytes"].items() if k not in ("routed_experts", "total"))
    assert doc["cache"]["kv_bytes_per_token"] == 16_992
    assert doc["cache"]["kda_recurrent_bytes_per_seq_per_layer"] == 6_291_456
    plan = doc["plan"]
    assert plan["meets_slo"] and plan["tpot_ms"] <= 50
    assert plan["decode"]["step"]["bound"] in ("compute", "HBM", "scale-up link", "scale-out link", "latency")
    assert any(line.startswith("vllm serve moonshotai/Kimi-K3.1-Pro") for line in doc["recipe"]["vllm"])
    assert any("sglang.launch_server" in line for line in doc["recipe"]["sglang"])
    assert any("-m deltamoe serve kimi-k3.1-pro --host 0.0.0.0 --tp " in line for line in doc["recipe"]["deltamoe"])


def test_table_output_and_user_hardware_file():
    res = runner.invoke(_app(), ["--model", "kimi-k3.1-pro", "--hardware",
                                 "deltamoe/plan/examples/m890-superpod-assumed.yaml", "--kv-cache", "fp8"])
    assert res.exit_code == 0, res.output
    assert "m890-superpod-assumed" in res.stdout and "launch recipe" in res.stdout


def test_validate_json_lists_every_row():
    res = runner.invoke(_app(), ["--validate", "--json"])
    assert res.exit_code == 0
    rows = json.loads(res.stdout)
    assert len(rows) >= 12 and all("ratio" in r for r in rows)


def test_errors_are_one_line_with_exit_code_2(capsys):
    assert main(["plan", "--model", "kimi-k3", "--hardware", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown hardware" in err and "h200" in err
    assert main(["plan", "--model", "kimi-k3", "--hardware", "m890-superpod"]) == 2
    assert "hbm_tbps" in capsys.readouterr().err
    assert main(["plan", "--model", "kimi-k4", "--hardware", "h200"]) == 2
    assert "presets" in capsys.readouterr().err
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--weights", "int3"]) == 2


def _plan_json(*flags: str) -> dict:
    res = runner.invoke(_app(), ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4", "--json", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_without_slo_flags_the_plan_meets_interactive_targets_and_says_so():
    doc = _plan_json()
    assert (doc["workload"]["slo_ttft_s"], doc["workload"]["slo_tpot_s"]) == (3.0, 0.05)
    assert doc["slo_choice"].startswith("interactive default")
    plan, fastest = doc["plan"], doc["throughput_optimal_without_slo"]
    assert plan["meets_slo"] and plan["tpot_ms"] <= 50 and plan["ttft_ms"] <= 3000
    # The throughput-optimal plan shown beside it is faster per chip and far slower per token.
    assert fastest["output_tok_s_per_chip"] > plan["output_tok_s_per_chip"] and fastest["tpot_ms"] > 50


def test_no_slo_ranks_by_throughput_alone():
    doc = _plan_json("--no-slo")
    assert doc["workload"]["slo_ttft_s"] is None and doc["workload"]["slo_tpot_s"] is None
    assert doc["slo_choice"].startswith("none (--no-slo)") and "throughput_optimal_without_slo" not in doc
    assert doc["plan"]["output_tok_s_per_chip"] == _plan_json()["throughput_optimal_without_slo"]["output_tok_s_per_chip"]


def test_given_slo_is_used_as_given_without_the_default_for_the_other():
    doc = _plan_json("--slo-tpot", "0.1")
    assert (doc["workload"]["slo_ttft_s"], doc["workload"]["slo_tpot_s"]) == (None, 0.1)
    assert doc["slo_choice"] == "as given" and "throughput_optimal_without_slo" not in doc


def test_table_says_which_slo_and_why():
    res = runner.invoke(_app(), ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "TTFT <= 3 s, TPOT <= 50 ms — interactive default" in out
    assert "without the SLO" in out and "chosen plan (most output tok/s per chip that meets the SLO)" in out


def test_slo_flag_errors_are_one_line(capsys):
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--no-slo", "--slo-tpot", "0.05"]) == 2
    assert capsys.readouterr().err.startswith("error: no-slo: ")
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--slo-ttft", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: slo-ttft: ")


@pytest.mark.parametrize("args", [
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4"],
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "16", "--kv-cache", "fp8"],  # P/D, ep 11 / 10 planned
    ["--model", "kimi-k3", "--hardware", "gb200-nvl72", "--nodes", "1"],  # a rack: ep 9 planned
    ["--model", "kimi-k3.1-pro", "--hardware", "b300", "--nodes", "3"],  # ep 6 planned
    ["--model", "kimi-linear-48b", "--hardware", "h100", "--chips", "3"],  # 256 experts, ep 3 planned
])
def test_deltamoe_recipe_lines_are_commands_deltamoe_serve_accepts(monkeypatch, args):
    """Every printed `deltamoe serve` line (after a torchrun prefix, if any) runs the real command up to the
    model load: every flag parses, the layout passes the model's checks, the values reach the engine,
    and a torchrun prefix starts tp x ep processes."""
    import shlex

    from deltamoe.serve import cli as serve_cli
    from deltamoe.serve.engine.llm_engine import LLMEngine

    res = runner.invoke(_app(), [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    lines = [x for x in doc["recipe"]["deltamoe"] if not x.startswith("#") and " deltamoe serve " in x]
    assert len(lines) == (2 if doc["plan"].get("prefill") else 1)
    seen = {}

    class Loading(Exception):
        pass

    def engine(source, config, tokenizer, dtype, device, workers, connector=None):
        seen.update(source=source, config=config, device=device, workers=workers)
        raise Loading  # what a loaded engine would do next needs the GPUs

    monkeypatch.setattr(serve_cli, "bind_listen_address", lambda host, port: None)
    monkeypatch.setattr(serve_cli, "check_device", lambda device: device)  # this machine has no GPU
    monkeypatch.setattr(LLMEngine, "from_pretrained", staticmethod(engine))
    monkeypatch.setattr("deltamoe.serve.kv_transfer.roles.make_connector", lambda *a, **k: None)
    for line in lines:
        words = shlex.split(line.split("  #")[0])
        args = words[words.index("deltamoe") + 1:]
        assert args[:2] == ["serve", args[1]] and args[1] == doc["model"]
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        with pytest.raises(Loading):
            main(args)
        workers = seen["workers"]
        assert seen["config"].max_model_len == doc["workload"]["context"] + doc["workload"]["output"]
        assert seen["device"] == "cuda"
        assert doc["model"] != "kimi-k3" or 896 % workers.ep == 0
        if words[0] == "torchrun" and "<gpus-per-host>" not in words:
            assert int(words[words.index("--nnodes") + 1]) * int(words[words.index("--nproc-per-node") + 1]) == \
                workers.tp * workers.ep
        assert ("--kv-cache-dtype" in args) == (doc["kv_cache_format"] == "fp8")


def test_recipe_text_orders_the_blocks():
    res = runner.invoke(_app(), ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4"])
    text = res.stdout[res.stdout.index("launch recipe"):]
    assert text.index("# vLLM") < text.index("# SGLang") < text.index("# deltamoe serve")


def test_validate_refuses_a_model_or_hardware_it_would_ignore(capsys):
    assert main(["plan", "--validate", "--model", "kimi-k3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: validate: --model with --validate")
