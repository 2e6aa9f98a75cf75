"""A cost model of one training step inside a site: FSDP2, HSDP and federated node groups.

A model, not a measurement. Compute is 6 N T / (peak x MFU) FLOPs-seconds per GPU (the
dense-matmul count of a forward and backward, attention's own FLOPs left out). Each
collective is NCCL's ring: an all-gather or reduce-scatter of S bytes over n ranks moves
(n - 1) / n x S through every link of the ring and takes n - 1 steps of latency alpha; an
all-reduce is a reduce-scatter then an all-gather. Its bandwidth is the ring's slowest link:
a GPU's intra-node bandwidth inside a node; across nodes the node's inter-node bandwidth
(all its NICs, which NCCL's parallel rings share), divided among the collectives a node
runs at once (HSDP's and the groups' cross-node all-reduces run one per GPU of a node).
FSDP2 gathers every unit (decoder layer, root) twice (forward, and backward after
resharding) in the parameter dtype and reduce-scatters its gradient in the reduce dtype
(xffl's policy: bf16 gathers, fp32 reductions). The step time assumes FSDP2's prefetch hides
a step's collectives behind its compute (max of the two); a federated group's weight
average every K steps blocks, so its share (1/K of it) adds.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Model:
    """The model: parameters and decoder layers (FSDP2 units: the layers and the root)."""

    params: float = 8.03e9  # Llama-3.1-8B
    layers: int = 32


@dataclass(frozen=True)
class Machine:
    """A site's nodes and links (bandwidths in bytes/s, one direction)."""

    nodes: int = 128
    gpus_per_node: int = 4
    intra: float = 200 * GB  # a GPU's NVLink bandwidth inside a node
    inter: float = 50 * GB  # a node's inter-node bandwidth, all its NICs
    peak: float = 312e12  # a GPU's dense bf16 FLOP/s
    alpha_intra: float = 2e-6  # seconds per ring step inside a node
    alpha_inter: float = 5e-6  # seconds per ring step across nodes

    @property
    def ranks(self) -> int:
        """GPUs of the site (one rank each)."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Work:
    """A step's work per GPU and the bytes per parameter of each collective."""

    tokens: int = 8192  # tokens per GPU per step
    mfu: float = 0.4
    gather_bytes: int = 2  # bf16 all-gathers of the parameters
    reduce_bytes: int = 4  # fp32 gradient reductions
    weight_bytes: int = 4  # fp32 master weights, averaged by federated groups


@dataclass(frozen=True)
class Step:
    """One mode's modelled step: compute, collectives per step, the amortized average."""

    mode: str
    compute: float
    comm: float  # the per-step collectives (overlappable)
    average: float = 0.0  # the blocking weight average per step (its time / K)
    states_gib: float = 0.0  # fp32 weights, gradients, AdamW moments per GPU (16 B/param)

    @property
    def time(self) -> float:
        """Seconds per step: collectives hidden behind compute up to its length, + average."""
        return max(self.compute, self.comm) + self.average


def ring(ranks: int, size: float, bandwidth: float, alpha: float, units: int) -> float:
    """Seconds of a ring all-gather or reduce-scatter of ``size`` bytes over ``ranks``,
    issued as ``units`` collectives (one per FSDP2 unit): bandwidth plus latency."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) / ranks * size / bandwidth + units * (ranks - 1) * alpha


def compute_seconds(model: Model, machine: Machine, work: Work) -> float:
    """6 N T / (peak x MFU): a step's forward and backward matmuls on one GPU."""
    return 6 * model.params * work.tokens / (machine.peak * work.mfu)


def _link(machine: Machine, nodes: int, parallel: int = 1) -> tuple[float, float]:
    """(bandwidth, alpha) of a ring over ``nodes`` nodes, ``parallel`` rings sharing a
    node's NICs when it crosses nodes."""
    if nodes <= 1:
        return machine.intra, machine.alpha_intra
    return machine.inter / parallel, machine.alpha_inter


def sharded_comm(model: Model, machine: Machine, work: Work, nodes: int) -> float:
    """FSDP2 over every GPU of ``nodes`` nodes: two all-gathers and a reduce-scatter."""
    n = nodes * machine.gpus_per_node
    bandwidth, alpha = _link(machine, nodes)
    units = model.layers + 1
    gathers = 2 * ring(n, work.gather_bytes * model.params, bandwidth, alpha, units)
    return gathers + ring(n, work.reduce_bytes * model.params, bandwidth, alpha, units)


def cross_allreduce(model: Model, machine: Machine, bytes_per_param: int, groups: int,
                    group_nodes: int) -> float:
    """An all-reduce across ``groups`` groups of ``group_nodes`` nodes of each GPU's 1/shard
    of the parameters: every GPU of a node runs its own ring at once (their NICs shared)."""
    shard = group_nodes * machine.gpus_per_node
    size = bytes_per_param * model.params / shard
    bandwidth, alpha = machine.inter / machine.gpus_per_node, machine.alpha_inter
    return 2 * ring(groups, size, bandwidth, alpha, model.layers + 1)


def states_gib(model: Model, shard: int) -> float:
    """GiB of fp32 weights, gradients and AdamW's two moments per GPU (16 B a parameter)."""
    return 16 * model.params / shard / 2**30


def fsdp(model: Model, machine: Machine, work: Work) -> Step:
    """FSDP2 over all ranks of the site."""
    return Step("fsdp", compute_seconds(model, machine, work),
                sharded_comm(model, machine, work, machine.nodes),
                states_gib=states_gib(model, machine.ranks))


def hsdp(model: Model, machine: Machine, work: Work, shard_nodes: int = 1) -> Step:
    """HSDP: FSDP2 inside groups of ``shard_nodes`` nodes, the reduce-scattered gradient
    shards all-reduced across the groups (torch's HSDP)."""
    replicas = machine.nodes // shard_nodes
    comm = (sharded_comm(model, machine, work, shard_nodes)
            + cross_allreduce(model, machine, work.reduce_bytes, replicas, shard_nodes))
    return Step(f"hsdp (shard {shard_nodes} node{'s' * (shard_nodes > 1)})",
                compute_seconds(model, machine, work), comm,
                states_gib=states_gib(model, shard_nodes * machine.gpus_per_node))


def groups(model: Model, machine: Machine, work: Work, every: int,
           group_nodes: int = 1) -> Step:
    """Federated groups of ``group_nodes`` nodes, FSDP2 inside each, averaging their fp32
    weights every ``every`` steps (local SGD / xFFL's FL+FSDP)."""
    count = machine.nodes // group_nodes
    average = cross_allreduce(model, machine, work.weight_bytes, count, group_nodes)
    return Step(f"groups of {group_nodes} node{'s' * (group_nodes > 1)}, K={every}",
                compute_seconds(model, machine, work),
                sharded_comm(model, machine, work, group_nodes), average / every,
                states_gib=states_gib(model, group_nodes * machine.gpus_per_node))


def step_table(model: Model, machine: Machine, work: Work, group_nodes: int = 1,
               every: tuple[int, ...] = (1, 8, 64)) -> list[Step]:
    """FSDP (the baseline, first), HSDP and federated groups with each K of ``every``."""
    if machine.nodes % group_nodes:
        raise ValueError(f"--group-nodes {group_nodes} does not divide --nodes "
                         f"{machine.nodes}; use a divisor.")
    return [fsdp(model, machine, work), hsdp(model, machine, work, group_nodes),
            *(groups(model, machine, work, k, group_nodes) for k in every)]
