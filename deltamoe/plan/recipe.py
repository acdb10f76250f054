"""Launch recipes for a plan: the vLLM and SGLang lines, and the `deltamoe serve` line it plans.

Text only: the planner never launches anything. Multi-node rendezvous flags (addresses, ports,
node ranks) are placeholders in angle brackets because only the operator knows them. The vLLM and
SGLang lines use those servers' flags. The `deltamoe serve` line uses only flags `deltamoe serve`
accepts (a test parses it with the real command): one replica of tp * ep ranks, which differs
from the planned layout in ways its comment lines state (DELTAMOE_LAYOUT).
"""

from __future__ import annotations

from dataclasses import dataclass

from deltamoe.plan.accelerator import Hardware
from deltamoe.plan.search import Plan, PoolEstimate

HF_IDS = {
    "kimi-k3": "moonshotai/Kimi-K3",
    "kimi-k3.1-pro": "moonshotai/Kimi-K3.1-Pro",
    "kimi-linear-48b": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
}


DELTAMOE_LAYOUT = ("# deltamoe serve runs one replica over --tp x --ep ranks (spawned on one machine, or the ranks "
                   "of a torchrun job): attention heads, dense MLPs and the vocabulary split by --tp and replicated "
                   "over --ep; routed experts split by --ep only (num_experts / ep per rank, where this plan counts "
                   "num_experts / (tp x dp)), so each chip holds more expert weights than the plan's memory column; "
                   "--ep is the plan's dp where it divides the experts, else the largest divisor below it; "
                   "weights in --dtype (quantized checkpoints run on CPUs only)")

@dataclass(frozen=True)
class Recipe:
    deltamoe: list[str]
    vllm: list[str]
    sglang: list[str]

    def to_json(self) -> dict[str, list[str]]:
        return {"deltamoe": self.deltamoe, "vllm": self.vllm, "sglang": self.sglang}

    def text(self) -> str:
        blocks = [("vLLM", self.vllm), ("SGLang", self.sglang), ("deltamoe serve", self.deltamoe)]
        return "\n".join(f"# {title}\n" + "\n".join(lines) for title, lines in blocks)


def _nodes(pool: PoolEstimate, hw: Hardware) -> int:
    return max(1, -(-pool.layout.instance_chips // hw.chips_per_node))


def serve_layout(model: str, tp: int, dp: int, chips_per_node: int) -> tuple[int, int]:
    """(tp, ep) for `deltamoe serve`: ep the largest ep <= dp that the model's worker checks accept
    (ep divides the routed experts) and whose tp x ep ranks split evenly over server-sized nodes."""
    from deltamoe.errors import ConfigError
    from deltamoe.hf_config import load_config
    from deltamoe.serve.executor.config import WorkerConfig

    try:
        config = load_config(model)
    except ConfigError:
        return tp, dp  # a model the planner knows by its figures only: the line keeps the plan's layout
    for ep in range(dp, 0, -1):
        ranks = tp * ep
        nodes = -(-ranks // chips_per_node)
        if chips_per_node <= 8 and ranks % nodes:
            continue
        try:
            WorkerConfig(tp=tp, ep=ep).dims(config)
        except ConfigError:
            continue
        return tp, ep
    return tp, 1


def _deltamoe(model: str, pool: PoolEstimate, hw: Hardware, max_len: int, role: str | None, kv: str) -> list[str]:
    """Comment lines for what the line cannot express, then a `deltamoe serve` command that parses."""
    lay = pool.layout
    tp, ep = serve_layout(model, lay.tp, lay.dp, hw.chips_per_node)
    notes = [f"# {model}: a checkpoint folder in its place (the preset name serves random weights)"]
    if ep != lay.dp:
        notes.append(f"# --ep {ep}, not the plan's dp = {lay.dp}: deltamoe serve splits the routed experts evenly "
                     f"over --ep ranks")
    if lay.pp > 1:
        notes.append(f"# no pipeline stages in deltamoe serve: this line holds all layers on each of its "
                     f"{tp * ep} ranks (the plan splits them over pp = {lay.pp})")
    if lay.replicas > 1:
        notes.append(f"# run {lay.replicas} replicas of this line behind a load balancer"
                     + (" (or list each after the router's --" + role + ")" if role else ""))
    cache_gib = max(1, int(pool.memory.cache / 2**30))
    serve = (f"-m deltamoe serve {model} --host 0.0.0.0 --tp {tp} --ep {ep} --dtype bfloat16 --device cuda "
             f"--max-model-len {max_len} --cache-memory {cache_gib}GiB")
    if kv == "fp8":
        serve += " --kv-cache-dtype fp8"
    if role is not None:
        serve += f" --role {role} --kv-transfer mooncake --kv-transfer-host <this-node-ip>"
        notes.append("# the P/D hand-off is tested on CPUs (mooncake-transfer-engine-non-cuda over TCP); GPU pools "
                     "need Mooncake's CUDA build")
    if role != "prefill":
        serve += f" --max-num-seqs {pool.batch}"
    ranks = tp * ep
    if hw.vendor == "ascend":
        notes.append("# deltamoe runs on CUDA GPUs and CPUs, not Ascend NPUs: the line is for a GPU pool of this shape")
    if ranks <= hw.chips_per_node <= 8:
        return notes + ["python " + serve]
    if hw.chips_per_node > 8:  # a rack or pod: its hosts' GPU count is not a planner figure
        return notes + [f"torchrun --nnodes <hosts> --nproc-per-node <gpus-per-host> --node-rank <0..hosts-1> "
                        f"--master-addr <head-ip> --master-port <port> {serve}  # hosts x gpus-per-host = {ranks}; "
                        "run once per host"]
    nodes = -(-ranks // hw.chips_per_node)
    return notes + [f"torchrun --nnodes {nodes} --nproc-per-node {ranks // nodes} --node-rank <0..{nodes - 1}> "
                    f"--master-addr <head-ip> --master-port <port> {serve}  # run once per node"]


ROUTER_LINE = ("deltamoe router --host 0.0.0.0 --prefill http://<prefill-head-ip>:8000 "
               "--decode http://<decode-head-ip>:8000  # one --prefill / --decode per replica")


def _vllm(hf: str, weights: str, kv: str, pool: PoolEstimate, hw: Hardware, max_len: int, headroom: float,
          role: str | None) -> str:
    lay = pool.layout
    parts = [f"vllm serve {hf} --trust-remote-code", f"--tensor-parallel-size {lay.tp}",
             f"--data-parallel-size {lay.dp}", f"--pipeline-parallel-size {lay.pp}"]
    if lay.ep > 1:
        parts.append("--enable-expert-parallel")
    parts += [f"--max-model-len {max_len}", f"--gpu-memory-utilization {1 - headroom:.2f}"]
    if kv == "fp8":
        parts.append("--kv-cache-dtype fp8")
    if role != "prefill":
        parts.append(f"--max-num-seqs {pool.batch}")
    if hw.vendor == "ascend" and weights == "w4a8":
        parts.append("--quantization ascend")
    if role:
        connector = "MooncakeConnectorV1" if hw.vendor == "ascend" else "NixlConnector"
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        parts.append(f"--kv-transfer-config '{{\"kv_connector\":\"{connector}\",\"kv_role\":\"{kv_role}\"}}'")
    if _nodes(pool, hw) > 1:
        parts.append("--data-parallel-address <head-ip> --data-parallel-size-local "
                     f"{max(1, lay.dp // _nodes(pool, hw))}  # run once per node")
    return " ".join(parts)


def _sglang(hf: str, kv: str, pool: PoolEstimate, hw: Hardware, max_len: int, headroom: float,
            role: str | None) -> str:
    lay = pool.layout
    # SGLang's --tp is the whole instance stage width; --dp with --enable-dp-attention splits attention.
    parts = [f"python -m sglang.launch_server --model-path {hf} --trust-remote-code", f"--tp {lay.ep}"]
    if lay.dp > 1:
        parts += [f"--dp {lay.dp}", "--enable-dp-attention"]
    if lay.pp > 1:
        parts.append(f"--pp-size {lay.pp}")
    if lay.ep > 1:
        mode = "normal" if role == "prefill" else "low_latency"
        parts += [f"--ep {lay.ep}", "--moe-a2a-backend deepep", f"--deepep-mode {mode}"]
    parts += [f"--context-length {max_len}", f"--mem-fraction-static {1 - headroom - 0.05:.2f}"]
    if kv == "fp8":
        parts.append("--kv-cache-dtype fp8_e4m3")
    if role != "prefill":
        parts.append(f"--max-running-requests {pool.batch * lay.dp}")
    if role:
        parts += [f"--disaggregation-mode {role}", "--disaggregation-transfer-backend mooncake"]
    nodes = _nodes(pool, hw)
    if nodes > 1:
        parts.append(f"--nnodes {nodes} --node-rank <0..{nodes - 1}> --dist-init-addr <head-ip>:5000")
    if hw.vendor == "ascend":
        parts.append("--device npu --attention-backend ascend")
    return " ".join(parts)


def launch_recipe(plan: Plan, model: str, weights: str, kv: str, hw: Hardware) -> Recipe:
    hf = HF_IDS.get(model, model)
    max_len = plan.workload.context + plan.workload.output
    headroom = plan.workload.headroom
    pools: list[tuple[PoolEstimate, str | None]]
    if plan.prefill is None:
        pools = [(plan.decode, None)]
    else:
        pools = [(plan.prefill, "prefill"), (plan.decode, "decode")]
    out = Recipe([DELTAMOE_LAYOUT], [], [])
    for pool, role in pools:
        head = f"# {role or 'colocated'}: {pool.layout.describe()} on {pool.layout.chips} chips"
        out.deltamoe.extend([head, *_deltamoe(model, pool, hw, max_len, role, kv)])
        out.vllm.extend([head, _vllm(hf, weights, kv, pool, hw, max_len, headroom, role)])
        out.sglang.extend([head, _sglang(hf, kv, pool, hw, max_len, headroom, role)])
    if plan.prefill is not None:
        out.deltamoe.extend(["# the router in front of both pools (clients talk to it)", ROUTER_LINE])
    return out
