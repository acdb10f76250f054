"""Launch recipes for a plan: the vLLM and SGLang lines, and the `deltamoe serve` line it plans.

Text only: the planner never launches anything. Multi-node rendezvous flags (addresses, node
ranks) are placeholders in angle brackets because only the operator knows them. The vLLM and
SGLang lines use those servers' flags; `deltamoe serve` runs one replica on one device today,
so its line is the layout deltamoe plans to take and says so (DELTAMOE_PLANNED).
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


DELTAMOE_PLANNED = ("# planned, not yet supported: `deltamoe serve` runs one replica on one device today and "
                    "rejects these layout flags; run the vLLM or SGLang line")


@dataclass(frozen=True)
class Recipe:
    deltamoe: list[str]
    vllm: list[str]
    sglang: list[str]

    def to_json(self) -> dict[str, list[str]]:
        return {"deltamoe": self.deltamoe, "vllm": self.vllm, "sglang": self.sglang}

    def text(self) -> str:
        blocks = [("vLLM", self.vllm), ("SGLang", self.sglang), ("deltamoe serve (planned)", self.deltamoe)]
        return "\n".join(f"# {title}\n" + "\n".join(lines) for title, lines in blocks)


def _nodes(pool: PoolEstimate, hw: Hardware) -> int:
    return max(1, -(-pool.layout.instance_chips // hw.chips_per_node))


def _deltamoe(model: str, weights: str, kv: str, pool: PoolEstimate, max_len: int, role: str | None) -> str:
    lay = pool.layout
    line = (f"deltamoe serve --model {model} --weights {weights} --kv-cache {kv} --tp {lay.tp} --dp {lay.dp} "
            f"--ep {lay.ep} --pp {lay.pp} --max-model-len {max_len}")
    if role != "prefill":
        line += f" --max-num-seqs {pool.batch}"
    if role:
        line += f" --role {role}"
    return line


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
    out = Recipe([DELTAMOE_PLANNED], [], [])
    for pool, role in pools:
        head = f"# {role or 'colocated'}: {pool.layout.describe()} on {pool.layout.chips} chips"
        out.deltamoe.extend([head, _deltamoe(model, weights, kv, pool, max_len, role)])
        out.vllm.extend([head, _vllm(hf, weights, kv, pool, hw, max_len, headroom, role)])
        out.sglang.extend([head, _sglang(hf, kv, pool, hw, max_len, headroom, role)])
    return out
