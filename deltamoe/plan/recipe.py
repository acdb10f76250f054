"""Launch recipes for a plan: the vLLM and SGLang lines, and the `deltamoe serve` line it plans.

Text only: the planner never launches anything. Multi-node rendezvous flags (addresses, ports,
node ranks) are placeholders in angle brackets because only the operator knows them. The vLLM and
SGLang lines use those servers' flags. The `deltamoe serve` line uses only flags `deltamoe serve`
accepts (a test parses it with the real command): replicas of tp * ep ranks whose weights fit the
chip (`serve_layout` computes each rank's bytes the way `deltamoe serve` shards them), which
differ from the planned layout in ways its comment lines state (DELTAMOE_LAYOUT). When no such
layout fits the pool, the line is printed commented out under a comment naming the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltamoe.config import ModelConfig
from deltamoe.errors import ConfigError
from deltamoe.plan.accelerator import Hardware
from deltamoe.plan.costs import ModelCosts
from deltamoe.plan.layout import divisors
from deltamoe.plan.search import GB, Plan, PoolEstimate

HF_IDS = {
    "kimi-k3": "moonshotai/Kimi-K3",
    "kimi-k3.1-pro": "moonshotai/Kimi-K3.1-Pro",
    "kimi-linear-48b": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
}

SERVE_DTYPE_BYTES = 2  # the line's --dtype bfloat16
VLLM_RPC_PORT = 13345  # --data-parallel-rpc-port: any free port, the same on every node
CANNOT_LOAD = "# (cannot load) "  # prefix of a deltamoe serve line whose weights do not fit

DELTAMOE_LAYOUT = ("# deltamoe serve runs replicas of --tp x --ep ranks (spawned on one machine, or the ranks "
                   "of a torchrun job): attention heads, dense MLPs, shared experts and the vocabulary split by "
                   "--tp; routed experts split by --ep only (num_experts / ep per rank); the low-rank projections, "
                   "DSA indexer, router, latent MoE projections, norms and vision tower whole on every rank. "
                   "No DP attention and no pipeline stages: the line's tp x ep is the layout that spans the "
                   "pool's chips with the fewest ranks per replica whose weights fit a chip. Weights load in "
                   "--dtype bfloat16 whatever --weights says: deltamoe runs a quantized (compressed-tensors) "
                   "checkpoint packed on CPU ranks only (docs/quantization.md: its packed experts split by --ep, "
                   "its int4 projections by --tp), so on GPUs serve the bfloat16 checkpoint")


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


def _even_nodes(chips: int, per_node: int) -> int:
    """The fewest nodes of `per_node` chips over which `chips` split evenly (launchers start the same
    number of processes on every node)."""
    first = max(1, -(-chips // per_node))
    return next(n for n in range(first, chips + 1) if chips % n == 0)


# ------------------------------------------------------------------ deltamoe serve
def serve_weight_bytes(costs: ModelCosts, tp: int, ep: int, bytes_per_param: float = SERVE_DTYPE_BYTES) -> float:
    """Weight bytes on one rank of `deltamoe serve --tp tp --ep ep` (docs/serving-workers.md and
    parallel/tensor_parallel.py): routed experts / ep; attention heads (q/q_b, kv_b, KDA q/k/v/f_b/b/g,
    output projections), dense MLPs, shared experts, embedding and lm_head / tp; the low-rank "a"
    projections (q_a, kv_a, f_a, g_a), the DSA indexer, router, latent MoE projections, norms and the
    vision tower whole. All at `bytes_per_param` (the line's --dtype)."""
    p, c = costs.params, costs.cfg
    d = c.hidden_size
    mla_whole = (d * c.q_lora_rank + c.q_lora_rank if c.q_lora_rank else 0) + d * c.latent_cache_dim + c.kv_lora_rank
    kda_whole = d * c.kda_head_dim * (2 if c.kda_output_gate != "full_rank" else 1)
    whole_attention = p.n_mla * mla_whole + p.n_kda * kda_whole + p.n_dsa * p.dsa_indexer
    split = (p.attention - whole_attention + p.n_dense * p.dense_mlp + p.n_moe * p.shared_experts + p.embedding
             + (0 if p.tied_embeddings else p.lm_head))
    whole = whole_attention + p.n_moe * (p.router + p.latent_proj) + p.norms + p.vision
    routed = p.n_moe * p.expert * p.num_experts / ep
    return (routed + split / tp + whole) * bytes_per_param


@dataclass(frozen=True)
class ServeLayout:
    """A `deltamoe serve --tp --ep` layout for a pool: `replicas` copies of tp x ep ranks."""

    tp: int
    ep: int
    replicas: int
    weight_bytes: float  # per rank, in the line's --dtype
    usable_bytes: float  # per chip: memory x (1 - headroom) - workspace
    seq_bytes: float  # cache of one sequence on one rank (latent KV whole, KDA state / tp)

    @property
    def ranks(self) -> int:
        return self.tp * self.ep

    @property
    def free_bytes(self) -> float:
        return self.usable_bytes - self.weight_bytes

    @property
    def fits(self) -> bool:
        return self.free_bytes >= max(self.seq_bytes, 2**30)  # weights + one sequence + 1 GiB of cache


def _serve_checks(cfg: ModelConfig, tp: int, ep: int) -> bool:
    from deltamoe.serve.executor.config import WorkerConfig

    try:
        WorkerConfig(tp=tp, ep=ep).dims(cfg)
    except ConfigError:
        return False
    return True


def _serve_candidates(costs: ModelCosts, hw: Hardware, headroom: float, workspace_gb: float, context: int,
                      max_ranks: int | None) -> list[ServeLayout]:
    """Every (tp, ep) `deltamoe serve` accepts for the model, with at most `max_ranks` ranks (None: any).
    Any count of ranks splits evenly over some number of nodes (`_even_nodes`)."""
    cfg = costs.cfg
    usable = hw.need("mem_gb", "the deltamoe serve line") * GB * (1 - headroom) - workspace_gb * GB
    out = []
    for tp in divisors(cfg.vocab_size):
        if max_ranks is not None and tp > max_ranks:
            break
        if not _serve_checks(cfg, tp, 1):
            continue
        for ep in divisors(cfg.num_experts) if cfg.num_experts else [1]:
            ranks = tp * ep
            if max_ranks is not None and ranks > max_ranks:
                break
            if ep > 1 and not _serve_checks(cfg, tp, ep):
                continue
            seq = context * costs.kv_bytes_per_token + costs.kda_state_bytes_per_seq / tp
            out.append(ServeLayout(tp, ep, (max_ranks or ranks) // ranks, serve_weight_bytes(costs, tp, ep),
                                   usable, seq))
    return out


def serve_layout(costs: ModelCosts, hw: Hardware, chips: int, headroom: float = 0.10, workspace_gb: float = 4.0,
                 context: int = 8192) -> tuple[ServeLayout | None, ServeLayout | None]:
    """(the layout the line prints, or None; the smallest layout that fits on any number of chips, or None).

    The printed layout: of the (tp, ep) `deltamoe serve` accepts on at most `chips` ranks whose weights
    fit a chip, the one whose replicas cover the most chips, then the fewest ranks per replica (more
    replicas: more sequences in parallel), then the fewest weight bytes per rank; when none fits, the
    one with the fewest weight bytes per rank (printed commented out).
    """
    cands = _serve_candidates(costs, hw, headroom, workspace_gb, context, chips)
    if not cands:
        return None, None
    fitting = [s for s in cands if s.fits]
    if fitting:
        best = max(fitting, key=lambda s: (s.replicas * s.ranks, -s.ranks, -s.weight_bytes))
        return best, best
    best = min(cands, key=lambda s: (s.weight_bytes, -s.replicas * s.ranks))  # the closest to fitting
    fitting = [s for s in _serve_candidates(costs, hw, headroom, workspace_gb, context, None) if s.fits]
    smallest = min(fitting, key=lambda s: (s.ranks, s.weight_bytes)) if fitting else None
    return best, smallest


def _torchrun(serve: str, ranks: int, hw: Hardware) -> str:
    if ranks <= hw.chips_per_node <= 8:
        return "python " + serve
    if hw.chips_per_node > 8:  # a rack or pod: its hosts' GPU count is not a planner figure
        return (f"torchrun --nnodes <hosts> --nproc-per-node <gpus-per-host> --node-rank <0..hosts-1> "
                f"--master-addr <head-ip> --master-port <port> {serve}  # hosts x gpus-per-host = {ranks}; "
                "run once per host")
    nodes = _even_nodes(ranks, hw.chips_per_node)
    return (f"torchrun --nnodes {nodes} --nproc-per-node {ranks // nodes} --node-rank <0..{nodes - 1}> "
            f"--master-addr <head-ip> --master-port <port> {serve}  # run once per node")


def _deltamoe(model: str, costs: ModelCosts, pool: PoolEstimate, hw: Hardware, max_len: int, role: str | None,
              kv: str, headroom: float, workspace_gb: float, context: int) -> list[str]:
    """Comment lines for what the line cannot express, then a `deltamoe serve` command that parses,
    commented out (CANNOT_LOAD) when no layout's weights fit the pool's chips."""
    lay = pool.layout

    def size(x: float) -> str:
        return f"{x / GB:,.1f} GB" if x >= 0.1 * GB else f"{x / 2**20:,.1f} MiB"

    layout, smallest = serve_layout(costs, hw, lay.chips, headroom, workspace_gb, context)
    notes = [f"# {model}: a checkpoint folder in its place (the preset name serves random weights)"]
    if layout is None:
        return notes + [f"# no --tp x --ep of deltamoe serve fits {model} on {lay.chips} ranks"]
    tp, ep = layout.tp, layout.ep
    if not layout.fits:
        need = (f"the smallest layout that holds them is --tp {smallest.tp} --ep {smallest.ep} on {smallest.ranks} "
                f"x {hw.name} ({size(smallest.weight_bytes)} per rank)" if smallest else
                f"no --tp x --ep of any size holds them on a {hw.name}")
        notes.append(f"# deltamoe serve cannot load {model} on these {lay.chips} x {hw.name}: its bfloat16 weights "
                     f"({costs.params.total * SERVE_DTYPE_BYTES / GB:,.0f} GB in all) put {size(layout.weight_bytes)} "
                     f"on each rank "
                     f"of --tp {tp} --ep {ep}, the layout with the least, against {size(layout.usable_bytes)} "
                     f"usable of a {hw.need('mem_gb', 'the deltamoe serve line'):g} GB chip (after --headroom "
                     f"and the workspace); {need}. The line below is commented out")
        cache, seqs = 2**30, 1
    else:
        notes.append(f"# --tp {tp} --ep {ep}: {size(layout.weight_bytes)} of bfloat16 weights per rank, of "
                     f"{size(layout.usable_bytes)} usable per chip")
        cache = min(pool.memory.cache, layout.free_bytes) if role == "prefill" else \
            min(pool.batch * layout.seq_bytes, layout.free_bytes)
        cache = max(2**30, cache)
        seqs = max(1, min(pool.batch, int(cache // layout.seq_bytes)))
        if role != "prefill" and seqs < pool.batch:
            notes.append(f"# --max-num-seqs {seqs}, not the plan's {pool.batch}: each rank holds every sequence's "
                         f"latent cache, and {size(cache)} is what the weights leave")
    if lay.pp > 1:
        notes.append(f"# no pipeline stages in deltamoe serve: each of the {tp * ep} ranks holds all layers "
                     f"(the plan splits them over pp = {lay.pp})")
    if layout.replicas > 1:
        notes.append(f"# run {layout.replicas} replicas of this line on the pool's {lay.chips} chips behind a "
                     "load balancer" + (" (or list each after the router's --" + role + ")" if role else ""))
    elif layout.ranks < lay.chips:
        notes.append(f"# uses {layout.ranks} of the pool's {lay.chips} chips: no layout of deltamoe serve "
                     f"spans all of them")
    serve = (f"-m deltamoe serve {model} --host 0.0.0.0 --tp {tp} --ep {ep} --dtype bfloat16 --device cuda "
             f"--max-model-len {max_len} --cache-memory {max(1, int(cache / 2**30))}GiB")
    if kv == "fp8":
        serve += " --kv-cache-dtype fp8"
    if role is not None:
        serve += f" --role {role} --kv-transfer mooncake --kv-transfer-host <this-node-ip>"
        notes.append("# the P/D hand-off is tested on CPUs (mooncake-transfer-engine-non-cuda over TCP); GPU pools "
                     "need Mooncake's CUDA build")
    if role != "prefill":
        serve += f" --max-num-seqs {seqs}"
    if hw.vendor == "ascend":
        notes.append("# deltamoe runs on CUDA GPUs and CPUs, not Ascend NPUs: the line is for a GPU pool of this shape")
    line = _torchrun(serve, tp * ep, hw)
    return notes + [line if layout.fits else CANNOT_LOAD + line]


ROUTER_LINE = ("deltamoe router --host 0.0.0.0 --prefill http://<prefill-head-ip>:8000 "
               "--decode http://<decode-head-ip>:8000  # one --prefill / --decode per replica")


# ------------------------------------------------------------------ vLLM
def _vllm(hf: str, weights: str, kv: str, pool: PoolEstimate, hw: Hardware, max_len: int, headroom: float,
          role: str | None) -> list[str]:
    """One `vllm serve` per node (Data Parallel Deployment, internal load balancing): the head node runs
    the API server and DP ranks 0..L-1, every other node `--headless` with its `--data-parallel-start-rank`;
    a DP rank wider than a node (TP x PP) runs on a Ray cluster instead."""
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
    base = " ".join(parts)
    if _nodes(pool, hw) == 1 and (hw.chips_per_node <= 8 or lay.instance_chips <= 8):
        return [base]
    rank_chips, per_node = lay.tp * lay.pp, hw.chips_per_node
    dp_flags = f"--data-parallel-address <head-ip> --data-parallel-rpc-port {VLLM_RPC_PORT}"
    if per_node > 8:  # a rack or pod of hosts whose GPU count is not a planner figure
        return [f"# one line per host, each with the DP ranks on its GPUs (GPUs per host / {rank_chips}); the "
                f"local sizes add up to {lay.dp}. Where one DP rank's {rank_chips} GPUs (TP{lay.tp} x PP{lay.pp}) "
                "span hosts, run the first line alone on a Ray cluster instead, with --data-parallel-backend ray "
                "and VLLM_RAY_DP_PACK_STRATEGY=span",
                f"{base} --data-parallel-size-local <dp-ranks-on-host> {dp_flags}  # the head host (API server)",
                f"{base} --headless --data-parallel-size-local <dp-ranks-on-host> --data-parallel-start-rank "
                f"<first-dp-rank-on-host> {dp_flags}  # every other host"]
    if rank_chips > per_node:  # one DP rank spans nodes: vLLM places it through Ray
        notes = [f"# one DP rank (TP{lay.tp} x PP{lay.pp}) spans {rank_chips} GPUs, more than a node: start a Ray "
                 "cluster first (`ray start --head` on the head node, `ray start --address <head-ip>:6379` on "
                 "each other node), then run this once, on the head node"]
        if lay.dp == 1:
            return notes + [f"{base} --distributed-executor-backend ray"]
        return notes + [f"VLLM_RAY_DP_PACK_STRATEGY=span {base} --data-parallel-backend ray"]
    local = per_node // rank_chips  # DP ranks per node
    nodes = -(-lay.dp // local)
    sizes = [min(local, lay.dp - k * local) for k in range(nodes)]  # DP ranks on node k; they add up to dp
    ranks = "DP rank 0" if sizes[0] == 1 else f"DP ranks 0..{sizes[0] - 1}"
    lines = [f"{base} --data-parallel-size-local {sizes[0]} {dp_flags}  # node 0 (API server, {ranks})"]

    def headless(size: int, start: str, where: str) -> str:
        return (f"{base} --headless --data-parallel-size-local {size} --data-parallel-start-rank {start} "
                f"{dp_flags}  # {where}")

    if nodes <= 4:
        lines += [headless(sizes[k], str(k * local), f"node {k}") for k in range(1, nodes)]
    else:
        uniform = nodes - 1 if sizes[-1] == local else nodes - 2
        lines.append(headless(local, f"<{local} x k>" if local > 1 else "<k>", f"node k = 1..{uniform}"))
        if uniform < nodes - 1:
            lines.append(headless(sizes[-1], str((nodes - 1) * local), f"node {nodes - 1}"))
    return lines


# ------------------------------------------------------------------ SGLang
def _sglang(hf: str, kv: str, pool: PoolEstimate, hw: Hardware, max_len: int, headroom: float,
            role: str | None, num_experts: int) -> list[str]:
    lay = pool.layout
    notes: list[str] = []
    # SGLang's --tp is the whole instance stage width; --dp with --enable-dp-attention splits attention.
    parts = [f"python -m sglang.launch_server --model-path {hf} --trust-remote-code", f"--tp {lay.ep}"]
    if lay.dp > 1:
        parts += [f"--dp {lay.dp}", "--enable-dp-attention"]
    if lay.pp > 1:
        parts.append(f"--pp-size {lay.pp}")
    if lay.ep > 1:
        mode = "normal" if role == "prefill" else "low_latency"
        parts += [f"--ep {lay.ep}", "--moe-a2a-backend deepep", f"--deepep-mode {mode}"]
        redundant = -num_experts % lay.ep
        if redundant:  # SGLang's MoE layers need (experts + redundant experts) % ep == 0
            parts.append(f"--ep-num-redundant-experts {redundant}")
            notes.append(f"# --ep {lay.ep} does not divide the {num_experts} routed experts: {redundant} redundant "
                         f"experts make {num_experts + redundant} = {(num_experts + redundant) // lay.ep} per rank "
                         "(not in the plan's memory column)")
    parts += [f"--context-length {max_len}", f"--mem-fraction-static {1 - headroom - 0.05:.2f}"]
    if kv == "fp8":
        parts.append("--kv-cache-dtype fp8_e4m3")
    if role != "prefill":
        parts.append(f"--max-running-requests {pool.batch * lay.dp}")
    if role:
        parts += [f"--disaggregation-mode {role}", "--disaggregation-transfer-backend mooncake"]
    if _nodes(pool, hw) == 1 and hw.chips_per_node > 8 and lay.instance_chips > 8:  # hosts of a rack or pod
        parts.append("--nnodes <hosts> --node-rank <0..hosts-1> --dist-init-addr <head-ip>:5000")
        notes.append(f"# hosts x GPUs per host = {lay.instance_chips}, the same number of GPUs on every host")
    elif _nodes(pool, hw) > 1:
        gpus = lay.instance_chips
        nodes = _even_nodes(gpus, hw.chips_per_node)
        if nodes != _nodes(pool, hw):
            notes.append(f"# {gpus} GPUs over {nodes} nodes of {gpus // nodes}: SGLang starts the same number of "
                         f"GPUs on every node (set CUDA_VISIBLE_DEVICES to {gpus // nodes} of each node's GPUs)")
        parts.append(f"--nnodes {nodes} --node-rank <0..{nodes - 1}> --dist-init-addr <head-ip>:5000")
    if hw.vendor == "ascend":
        parts.append("--device npu --attention-backend ascend")
    return notes + [" ".join(parts)]


def launch_recipe(plan: Plan, model: str, weights: str, kv: str, hw: Hardware,
                  costs: ModelCosts | None = None) -> Recipe:
    if costs is None:  # callers that planned from a name: the same costs again
        from deltamoe.plan.cli import _model
        from deltamoe.plan.costs import model_costs

        costs = model_costs(_model(model), weights, kv)
    hf = HF_IDS.get(model, model)
    w = plan.workload
    max_len = w.context + w.output
    headroom = w.headroom
    pools: list[tuple[PoolEstimate, str | None]]
    if plan.prefill is None:
        pools = [(plan.decode, None)]
    else:
        pools = [(plan.prefill, "prefill"), (plan.decode, "decode")]
    out = Recipe([DELTAMOE_LAYOUT], [], [])
    for pool, role in pools:
        head = f"# {role or 'colocated'}: {pool.layout.describe()} on {pool.layout.chips} chips"
        out.deltamoe.extend([head, *_deltamoe(model, costs, pool, hw, max_len, role, kv, headroom, w.workspace_gb,
                                              w.decode_context)])
        out.vllm.extend([head, *_vllm(hf, weights, kv, pool, hw, max_len, headroom, role)])
        out.sglang.extend([head, *_sglang(hf, kv, pool, hw, max_len, headroom, role, costs.cfg.num_experts)])
    if plan.prefill is not None:
        out.deltamoe.extend(["# the router in front of both pools (clients talk to it)", ROUTER_LINE])
    return out
