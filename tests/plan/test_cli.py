"""`deltamoe plan` end to end: JSON output, validation, one-line errors with exit code 2."""

import json

import pytest
import typer
from typer.testing import CliRunner

from deltamoe.cli import main
from deltamoe.plan.cli import plan_command
from deltamoe.plan.recipe import CANNOT_LOAD

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


def test_an_slo_no_layout_reaches_says_so(capsys):
    """The model fits 32 x h200; a 5 ms TPOT is what no layout reaches: the error names the SLO, not the
    fit. A TTFT no layout reaches still prints the best plan, headed as not meeting it."""
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--nodes", "4", "--slo-tpot", "0.005"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: slo-tpot: no layout of 32 x h200 meets the SLO (TPOT <= 5 ms)") and "fits" in err
    res = runner.invoke(_app(), ["--model", "kimi-k3", "--hardware", "h200", "--nodes", "4", "--slo-ttft", "0.01"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.split())
    assert "chosen plan (no layout meets the SLO; most output tok/s per chip)" in out and "[SLO NOT MET]" in out


def test_slo_flag_errors_are_one_line(capsys):
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--no-slo", "--slo-tpot", "0.05"]) == 2
    assert capsys.readouterr().err.startswith("error: no-slo: ")
    assert main(["plan", "--model", "kimi-k3", "--hardware", "h200", "--slo-ttft", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: slo-ttft: ")


@pytest.mark.parametrize("args", [
    ["--model", "kimi-k3", "--hardware", "b300", "--nodes", "8"],  # bf16 K3 fits: --tp 2 --ep 32 on 64 chips
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4"],
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "16", "--kv-cache", "fp8"],  # P/D, ep 11 / 10 planned
    ["--model", "kimi-k3", "--hardware", "gb200-nvl72", "--nodes", "1"],  # a rack: ep 9 planned
    ["--model", "kimi-k3.1-pro", "--hardware", "b300", "--nodes", "3"],  # ep 6 planned
    ["--model", "kimi-linear-48b", "--hardware", "h100", "--chips", "3"],  # 256 experts, ep 3 planned
])
def test_deltamoe_recipe_lines_are_commands_deltamoe_serve_accepts(monkeypatch, args):
    """Every printed `deltamoe serve` line (after a torchrun prefix, if any) runs the real command up to the
    model load: every flag parses, the layout passes the model's checks, the values reach the engine,
    and a torchrun prefix starts tp x ep processes. A line whose weights fit no chip is printed commented
    out, after a comment that says so; it still parses."""
    import shlex

    from deltamoe.serve import cli as serve_cli
    from deltamoe.serve.engine.llm_engine import LLMEngine

    res = runner.invoke(_app(), [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    recipe = doc["recipe"]["deltamoe"]
    lines = [x.removeprefix(CANNOT_LOAD) for x in recipe
             if (x.startswith(CANNOT_LOAD) or not x.startswith("#")) and " deltamoe serve " in x]
    assert len(lines) == (2 if doc["plan"].get("prefill") else 1)
    for i, x in enumerate(recipe):
        if x.startswith(CANNOT_LOAD):
            assert any("# deltamoe serve cannot load" in y for y in recipe[:i])
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


def _recipe(*args: str) -> dict:
    res = runner.invoke(_app(), [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_deltamoe_line_holds_the_weights_it_prints_or_says_it_cannot():
    """Per-rank bytes as deltamoe serve shards them: routed experts / ep, the rest / tp (low-rank parts
    whole), in the line's --dtype bfloat16. K3.1 Pro (5.56 TB in BF16) cannot load on 32 H200 (4.5 TB)."""
    from deltamoe.config import load_preset
    from deltamoe.plan.costs import model_costs
    from deltamoe.plan.recipe import serve_weight_bytes

    k3 = model_costs(load_preset("kimi-k3"), "mxfp4", "bf16")
    p = k3.params
    assert serve_weight_bytes(k3, 1, 1) == p.total * 2 == 5_559_863_669_952  # `deltamoe info`'s BF16 figure
    routed = p.n_moe * p.expert * p.num_experts * 2
    assert serve_weight_bytes(k3, 1, 1) - serve_weight_bytes(k3, 1, 64) == pytest.approx(routed * 63 / 64)

    doc = _recipe("--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4")
    lines = doc["recipe"]["deltamoe"]
    note = next(x for x in lines if x.startswith("# deltamoe serve cannot load"))
    assert "5,560 GB in all" in note and "284.9 GB on each rank of --tp 1 --ep 32" in note
    assert "122.9 GB usable of a 141 GB chip" in note and "--tp 2 --ep 112 on 224 x h200" in note
    cmd = next(x for x in lines if " deltamoe serve " in x and "--tp" in x and not x.startswith("# deltamoe"))
    assert cmd.startswith("# (cannot load) torchrun --nnodes 4 --nproc-per-node 8 ") and "--tp 1 --ep 32 " in cmd

    # 64 B300 hold K3 in BF16: the line spans all 64 chips, ep divides the 896 experts, and its bytes fit.
    doc = _recipe("--model", "kimi-k3", "--hardware", "b300", "--nodes", "8")
    lines = doc["recipe"]["deltamoe"]
    cmd = next(x for x in lines if x.startswith("torchrun"))
    assert "--nnodes 8 --nproc-per-node 8 " in cmd and "--tp 1 --ep 64 " in cmd and "--max-num-seqs 54" in cmd
    assert "# --tp 1 --ep 64: 199.5 GB of bfloat16 weights per rank, of 237.2 GB usable per chip" in lines
    assert serve_weight_bytes(k3, 1, 64) / 1e9 == pytest.approx(199.5, abs=0.05) and 896 % 64 == 0


def test_context_beyond_max_position_embeddings_is_a_context_error(capsys):
    # tiny allows 4096 positions: the default 8192 + 1024 would print a --max-model-len serve refuses.
    assert main(["plan", "--model", "tiny", "--hardware", "h100", "--chips", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: context: 8,192 prompt + 1,024 output tokens = 9,216, more than")
    assert "max_position_embeddings (4,096)" in err
    assert main(["plan", "--model", "kimi-k3", "--hardware", "gb200-nvl72", "--nodes", "2", "--context", "2000000",
                 "--no-slo"]) == 2
    assert "max_position_embeddings (1,048,576)" in capsys.readouterr().err
    doc = _recipe("--model", "tiny", "--hardware", "h100", "--chips", "1", "--context", "3072", "--output", "1024")
    assert any("--max-model-len 4096 " in x for x in doc["recipe"]["deltamoe"])  # exactly the limit is fine


@pytest.mark.parametrize("flags, field", [
    (["--slo-tpot", "nan"], "slo-tpot"),
    (["--slo-ttft", "nan"], "slo-ttft"),
    (["--slo-tpot", "inf"], "slo-tpot"),
    (["--draft-tokens", "2", "--accept-len", "nan"], "accept-len"),
    (["--draft-tokens", "2", "--accept-len", "inf"], "accept-len"),
])
def test_nan_and_inf_flags_are_one_line_errors(capsys, flags, field):
    assert main(["plan", "--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {field}: ")


def test_nan_in_a_hardware_file_is_refused_and_json_is_strict(tmp_path, capsys):
    bad = tmp_path / "nan.yaml"
    bad.write_text("name: x\nbase: h200\nhbm_tbps: .nan\n")
    assert main(["plan", "--model", "kimi-k3", "--hardware", str(bad), "--nodes", "4", "--json"]) == 2
    assert capsys.readouterr().err.startswith("error: hardware.hbm_tbps: ")
    ok = tmp_path / "ok.yaml"
    ok.write_text("name: x\nbase: h200\nhbm_tbps: 4.8\n")
    res = runner.invoke(_app(), ["--model", "kimi-k3", "--hardware", str(ok), "--nodes", "4", "--json"])
    assert res.exit_code == 0, res.output

    def no_constants(name):
        raise AssertionError(f"{name} in the plan's JSON")

    json.loads(res.stdout, parse_constant=no_constants)  # NaN / Infinity would be called out here


def test_vllm_multi_node_lines_name_each_nodes_dp_ranks():
    """vLLM's Data Parallel Deployment: the head node runs the API server; every other node runs
    --headless with its --data-parallel-start-rank, and the local sizes add up to the DP size."""
    import re

    for args, dp, sizes in ((("--nodes", "4"), 4, [1, 1, 1, 1]),  # TP8 x DP4: one DP rank per node
                            (("--chips", "20", "--no-slo"), 5, [2, 2, 1])):  # TP2 x PP2 x DP5 on 8 + 8 + 4 GPUs
        doc = _recipe("--model", "kimi-k3.1-pro", "--hardware", "h200", *args)
        lines = [x for x in doc["recipe"]["vllm"] if x.startswith("vllm serve")]
        assert all(f"--data-parallel-size {dp} " in x for x in lines)
        local = [int(re.search(r"--data-parallel-size-local (\d+)", x).group(1)) for x in lines]
        assert local == sizes and sum(local) == dp
        assert "--headless" not in lines[0] and "--data-parallel-start-rank" not in lines[0]
        starts = [int(re.search(r"--data-parallel-start-rank (\d+)", x).group(1)) for x in lines[1:]]
        assert all("--headless" in x for x in lines[1:]) and starts == [sum(sizes[:k]) for k in range(1, len(sizes))]
        assert all("--data-parallel-address <head-ip> --data-parallel-rpc-port 13345" in x for x in lines)


def test_vllm_dp_rank_wider_than_a_node_runs_on_ray():
    doc = _recipe("--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "16", "--kv-cache", "fp8")
    vllm = doc["recipe"]["vllm"]
    assert doc["plan"]["prefill"]["layout"]["describe"] == "TP2 x DP1 x PP8 (EP2) x 6 replicas"
    i = vllm.index(next(x for x in vllm if x.startswith("# prefill")))
    assert "ray start --head" in vllm[i + 1]
    assert vllm[i + 2].startswith("vllm serve") and vllm[i + 2].endswith("--distributed-executor-backend ray")
    assert "--data-parallel-size-local" not in vllm[i + 2]


@pytest.mark.parametrize("args", [
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--chips", "24", "--no-slo"],  # ep 3
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--chips", "20", "--no-slo"],  # ep 10 on 3 nodes
    ["--model", "kimi-k3.1-pro", "--hardware", "h200", "--nodes", "4"],
])
def test_sglang_ep_divides_the_experts_and_nodes_split_evenly(args):
    import re

    doc = _recipe(*args)
    lines = [x for x in doc["recipe"]["sglang"] if x.startswith("python -m sglang")]
    assert lines
    for x in lines:
        ep = int(re.search(r"--ep (\d+)", x).group(1))
        redundant = re.search(r"--ep-num-redundant-experts (\d+)", x)
        assert (896 + (int(redundant.group(1)) if redundant else 0)) % ep == 0
        gpus = int(re.search(r"--tp (\d+)", x).group(1)) * int((re.search(r"--pp-size (\d+)", x) or [0, 1])[1])
        nodes = re.search(r"--nnodes (\d+)", x)
        if nodes:
            assert gpus % int(nodes.group(1)) == 0 and gpus // int(nodes.group(1)) <= 8
    if args[-1] == "--no-slo" and args[-3] == "20":
        assert "--ep-num-redundant-experts 4" in lines[0] and "--nnodes 4 " in lines[0]  # 900 = 10 x 90; 4 x 5 GPUs


def test_plan_labels_what_its_fp8_total_counts():
    doc = _recipe("--model", "kimi-k3", "--hardware", "b300", "--nodes", "8", "--weights", "fp8")
    assert round(doc["weight_bytes"]["total"]) == 2_784_000_846_827  # `deltamoe info` FP8 (all FP8): 2,780,610,529,272
    assert "embedding, lm_head, router, norms and vision in BF16" in doc["weights_scheme_description"]
    res = runner.invoke(_app(), ["--model", "kimi-k3", "--hardware", "b300", "--nodes", "8", "--weights", "fp8"])
    assert "embedding, lm_head, router, norms and vision in BF16" in " ".join(res.stdout.split())
