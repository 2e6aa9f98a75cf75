"""Federated groups of ranks inside a site (``training.local_groups``): the mesh and the sync.

The site's W ranks form G groups of W/G consecutive ranks, on a mesh whose outermost
dimension is ``groups``: ("groups", "dp", "tp") or, under HSDP, ("groups", "replicate",
"shard"). Each group trains with the site's data and tensor parallelism on its inner
dimensions only, so no gradient crosses a group. Group a's ranks are the site's dp ranks
a*n .. a*n+n-1 (n = W/G/tp), and each reads the batches that dp rank reads under plain
data parallelism: the groups see disjoint rows of every step's batch, and their union is
what plain data parallelism sees in that step.

Every ``every`` optimizer steps, and once more at the end of the round (so that the site's
update is the groups' result), each rank all-reduces its local tensors over the ``groups``
dimension: rank i of group a and rank i of group b hold the same slice (FSDP2 shard, tensor-
parallel slice or whole replica), so an element-wise mean of local tensors is the mean of
the groups' models. ``outer: nesterov`` then applies DiLoCo's outer step (Douillard et al.
2023, as torchft's ``DiLoCo`` does it): the outer gradient is the weights at the last sync
minus that mean, and ``torch.optim.SGD(nesterov=True)`` steps the last sync's weights with
it; every group then continues from the result.

Communication: a sync all-reduces every local parameter (and AdamW's two moments with
``average_moments``) over G ranks; the bytes a rank hands to those all-reduces are counted
(a ring all-reduce sends 2 (G-1)/G of them per rank) and reported per sync, per step (per
sync / every) and per round, in the step lines and the round's metrics.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from xffl.aggregator import metrics as metric
from xffl.core.errors import InvalidInput
from xffl.training.group_spec import LocalGroupsSpec
from xffl.training.progress import Speed

if TYPE_CHECKING:
    from xffl.training.config import TrainingSpec
    from xffl.training.loop import AfterStep
    from xffl.training.parallelize import ParallelModel

def _local(t: Tensor) -> Tensor:
    """The tensor a rank holds of ``t``: a DTensor's local slice (a view of it), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GroupSync:
    """Averages the groups' models every ``spec.every`` steps; counts what that sends."""

    def __init__(self, spec: LocalGroupsSpec, pm: ParallelModel,
                 optimizer: torch.optim.Optimizer, steps: int,
                 keep_dir: Path | None = None) -> None:
        """``pm`` on a mesh of :func:`xffl.training.parallelize.group_mesh`; ``steps``
        planned in the round; ``keep_dir``: where each group's model is written before the
        round's last sync."""
        assert pm.mesh is not None and pm.groups == spec.groups
        self.spec = spec
        self.pm = pm
        self.steps = steps
        self.keep_dir = keep_dir
        self.process_group = pm.mesh.get_group("groups")
        self.optimizer = optimizer
        self.params = [p for p in pm.module.parameters() if p.requires_grad]
        self.since = 0  # steps since the last sync
        self.syncs = 0
        self.outer: torch.optim.SGD | None = None
        self.anchors: list[nn.Parameter] = []
        if spec.outer == "nesterov":  # the weights at the last sync, stepped by the outer SGD
            with torch.no_grad():
                self.anchors = [nn.Parameter(_local(p).detach().clone()) for p in self.params]
            self.outer = torch.optim.SGD(self.anchors, lr=spec.outer_lr,
                                         momentum=spec.outer_momentum, nesterov=True)
        moments = 3 if spec.average_moments else 1  # the weights, exp_avg, exp_avg_sq
        self.sync_bytes = moments * sum(_local(p).numel() * p.element_size()
                                        for p in self.params)
        self.planned = -(-steps // spec.every)  # syncs in a round that runs all its steps

    def _tensors(self) -> list[Tensor]:
        """The local tensors a sync averages: the parameters (and AdamW's moments)."""
        out = [_local(p) for p in self.params]  # under no_grad: views of the storage
        if self.spec.average_moments:
            for p in self.params:
                state = self.optimizer.state.get(p, {})
                out.extend(_local(state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state)
        return out

    def _keep(self) -> None:
        """Each group's model, gathered inside the group (collective) and written by the
        group's first rank to ``keep_dir/group-<g>.safetensors``."""
        assert self.keep_dir is not None and self.pm.mesh is not None
        from safetensors.torch import save_file

        state = {}
        for name, p in self.pm.module.named_parameters():  # the same order on every rank
            full = getattr(p, "full_tensor", None)
            state[name] = (full() if callable(full) else p).detach().to("cpu").contiguous()
        mesh = self.pm.mesh
        names = mesh.mesh_dim_names or ()
        if all(mesh.get_local_rank(d) == 0 for d in names if d != "groups"):
            self.keep_dir.mkdir(parents=True, exist_ok=True)
            save_file(state, str(self.keep_dir / f"group-{self.pm.group}.safetensors"))
        dist.barrier()

    @torch.no_grad()
    def sync(self, last: bool = False) -> None:
        """Average the groups' tensors (then DiLoCo's outer step, under ``nesterov``);
        ``last``: the round's last sync (each group's model is kept first, if asked)."""
        if last and self.keep_dir is not None:
            self._keep()
        tensors = self._tensors()
        handles = [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group,
                                   async_op=True) for t in tensors]
        for handle, t in zip(handles, tensors, strict=True):
            assert handle is not None
            handle.wait()
            t.div_(self.spec.groups)
        if self.outer is not None:
            for anchor, mean in zip(self.anchors, tensors, strict=True):
                anchor.grad = anchor.detach() - mean  # DiLoCo's outer gradient
            self.outer.step()
            for anchor, mean in zip(self.anchors, tensors, strict=True):
                mean.copy_(anchor.detach())
                anchor.grad = None
        self.since = 0
        self.syncs += 1

    def after_step(self, done: int) -> None:
        """Called after every optimizer step: a sync every ``every`` steps."""
        self.since += 1
        if self.since >= self.spec.every:
            self.sync(last=done >= self.steps)

    def finish(self) -> None:
        """The round's last sync (none when the last step synced already)."""
        if self.since:
            self.sync(last=True)

    def note(self) -> str:
        """What a step line adds: the groups, the interval and the bytes of the syncs."""
        per_step = self.sync_bytes / self.spec.every
        return (f" groups {self.spec.groups} every {self.spec.every} sync MB "
                f"{self.sync_bytes / 1e6:.3g} MB/step {per_step / 1e6:.3g} MB/round "
                f"{self.planned * self.sync_bytes / 1e6:.3g}")

    def metrics(self) -> dict[str, float]:
        """The round's metrics of the syncs: bytes a rank all-reduces per sync, per step
        (per sync / every) and in the round, and the syncs done."""
        return {metric.GROUP_SYNCS: float(self.syncs),
                metric.GROUP_SYNC_BYTES: float(self.sync_bytes),
                metric.GROUP_BYTES_PER_STEP: self.sync_bytes / self.spec.every,
                metric.GROUP_BYTES_ROUND: float(self.syncs * self.sync_bytes)}


def chain(sync: GroupSync | None, hook: AfterStep | None) -> AfterStep | None:
    """One after-step hook: the groups' sync first, then ``hook`` (a round's checkpoints)."""
    if sync is None:
        return hook
    group_sync = sync

    def after_step(done: int, losses: Tensor, loss_tokens: int) -> None:
        group_sync.after_step(done)
        if hook is not None:
            hook(done, losses, loss_tokens)

    return after_step


def make_sync(spec: LocalGroupsSpec | None, pm: ParallelModel,
              optimizer: torch.optim.Optimizer, steps: int,
              state_dir: Path | None = None, round: int = 0) -> GroupSync | None:
    """The round's GroupSync (None without ``training.local_groups`` or a process group);
    with ``keep``, the groups' models go to ``state_dir/groups/r<round>``."""
    if spec is None or pm.mesh is None or pm.groups < 2:
        return None
    keep_dir = Path(state_dir) / "groups" / f"r{round}" \
        if spec.keep and state_dir is not None else None
    return GroupSync(spec, pm, optimizer, steps, keep_dir)



def noted(speed: Speed, sync: GroupSync | None) -> Speed:
    """``speed`` whose step lines also say what the groups' syncs send."""
    return speed if sync is None else replace(speed, note=sync.note())


def check(spec: TrainingSpec, world: int) -> int:
    """The groups of a site of ``world`` ranks under ``spec`` (1 without local_groups); what
    does not combine with them is refused (``xffl validate`` says it with file:line first)."""
    groups = spec.local_groups
    if groups is None or world == 1:
        return 1
    if groups.ranks_per_group(world) is None:
        raise InvalidInput(f"training.local_groups.groups {groups.groups} does not divide the "
                           f"site's {world} ranks; choose a divisor of {world}.")
    if spec.checkpoint is not None:
        raise InvalidInput("training.checkpoint does not combine with training.local_groups "
                           "(a round checkpoint holds one model, not each group's); remove one.")
    if spec.lora is not None or spec.update_fn is not None:
        raise InvalidInput("training.local_groups does not combine with lora or update_fn; "
                           "remove one of them.")
    return groups.groups
