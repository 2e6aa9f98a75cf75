"""``xffl simulate --queue-waits``: simulated wall time to a target loss under batch queues.

N virtual sites each submit a job per round that waits in its facility's queue (drawn from
a distribution or a trace of observed waits, its scale differing by site), starts up, then
trains ``K`` local steps at the site's own speed. Three round policies run on the same
draws (same seeds):

* ``sync``: every round waits for every site;
* ``timeout``: ``failure.round_timeout`` T: a round closes at T, sites not in are cancelled
  and their work is lost (a round with fewer than the quorum is lost whole);
* ``queue_aware``: ``round_deadline`` D, ``late: adopt``: each site's steps are fit to D from its
  exponentially weighted estimates (:func:`xffl.workflows.steps.deadline.fit_steps`, the
  code real rounds use); the round closes at D (or when every site is in) with what
  arrived; a late job is left to finish, no second job is submitted for its site, and its
  update is admitted in the round it arrives in, as a delta against the global it started
  from, weighted by the job's staleness function (``round_deadline.staleness``).

Every round's global is, with ``m_i`` the sites' data sizes, ``tau_i`` the rounds late,
``Delta_i`` the update minus the global it started from:

    w' = w + sum_i m_i s(tau_i) Delta_i / sum_i m_i      (over the updates admitted)

The learning is a surrogate, not the job's model: federated least squares, each site with
its own optimum (non-IID), local full-batch gradient descent computed exactly through each
site's eigendecomposition (so a round costs O(N d^2), whatever K), and the federated
validation loss is the mean of the sites' population losses. Timeouts and deadlines are
swept over the same grid (multiples of the median synchronous job time) and the best of each
reported, with the simulated hours to the target.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xffl.core.errors import InvalidInput
from xffl.jobs.report.estimates import ALPHA, SiteEstimate, ewma
from xffl.jobs.spec.deadline import RoundDeadline, StalenessSpec
from xffl.workflows.steps.deadline import fit_steps

GRID = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)  # x the median synchronous job time
_SPEC = re.compile(r"(lognormal|pareto):([a-z]+=[0-9.eE+-]+(?:,[a-z]+=[0-9.eE+-]+)*)")
_PARAMS = {"lognormal": {"median", "sigma"}, "pareto": {"scale", "alpha"}}


@dataclass(frozen=True)
class QueueModel:
    """Where each job's queue wait comes from: a distribution or a trace of observed waits."""

    kind: str  # lognormal, pareto or trace
    params: dict[str, float] = field(default_factory=dict)
    trace: tuple[float, ...] = ()
    site_spread: float = 4.0  # each site's scale: log-uniform in [1/spread, spread]

    def draw(self, rng: np.random.Generator, scale: float) -> float:
        """One queue wait in seconds at a site of this ``scale``."""
        if self.kind == "trace":
            return float(self.trace[int(rng.integers(len(self.trace)))]) * scale
        if self.kind == "lognormal":
            return float(self.params["median"] * scale *
                         math.exp(self.params["sigma"] * rng.standard_normal()))
        # pareto (type I): scale x_m, tail index alpha; heavy-tailed for small alpha
        return float(self.params["scale"] * scale * (1 + rng.pareto(self.params["alpha"])))

    def median(self, scale: float) -> float:
        """The median wait at a site of this ``scale`` (SLURM's estimate stands in for it)."""
        if self.kind == "trace":
            return float(np.median(self.trace)) * scale
        if self.kind == "lognormal":
            return self.params["median"] * scale
        return float(self.params["scale"] * scale * 2 ** (1 / self.params["alpha"]))


def parse_queue_waits(text: str) -> QueueModel:
    """``lognormal:median=600,sigma=1.5`` or ``pareto:scale=300,alpha=1.2``; InvalidInput."""
    match = _SPEC.fullmatch(text.strip())
    if match is None:
        raise InvalidInput(f"--queue-waits {text!r}: give lognormal:median=S,sigma=X or "
                           "pareto:scale=S,alpha=X (seconds), e.g. lognormal:median=600,sigma=1.5.")
    kind = match.group(1)
    params = {}
    for pair in match.group(2).split(","):
        key, value = pair.split("=")
        params[key] = float(value)
    if set(params) != _PARAMS[kind] or not all(v > 0 and math.isfinite(v)
                                               for v in params.values()):
        raise InvalidInput(f"--queue-waits {text!r}: {kind} takes "
                           f"{' and '.join(sorted(_PARAMS[kind]))}, each a positive number.")
    return QueueModel(kind, params)


def read_trace(path: Path) -> QueueModel:
    """A trace file of observed queue waits: one number of seconds per line (# comments)."""
    waits = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidInput(f"--queue-trace {path}: cannot read it ({exc.strerror}).") from None
    for n, line in enumerate(lines, 1):
        text = line.split("#")[0].strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not (value >= 0 and math.isfinite(value)):
            raise InvalidInput(f"{path}:{n}: {text!r} is not a queue wait; give one number "
                               "of seconds (>= 0) per line.")
        waits.append(value)
    if not waits:
        raise InvalidInput(f"{path}: no queue wait in it; give one number of seconds per line.")
    return QueueModel("trace", trace=tuple(waits))


@dataclass
class Problem:
    """Federated least squares: site i's loss 0.5 (w - w_i)^T A_i (w - w_i), A_i = Q L Q^T."""

    opt: np.ndarray  # (N, d) each site's optimum
    eig: np.ndarray  # (N, d)
    basis: np.ndarray  # (N, d, d)
    lr: float

    @classmethod
    def make(cls, n: int, rng: np.random.Generator, d: int = 16,
             spread: float = 3.0) -> Problem:
        """``n`` non-IID sites: their own optimum around a common one and their own data."""
        center = rng.standard_normal(d)
        opt = center + spread * rng.standard_normal((n, d)) / math.sqrt(d)
        x = rng.standard_normal((n, 4 * d, d)) * rng.uniform(0.2, 1.0, (n, 1, d))
        a = np.einsum("nki,nkj->nij", x, x) / (4 * d)
        eig, basis = np.linalg.eigh(a)
        return cls(opt, eig, basis, lr=0.02 / float(eig.max()))

    def local(self, i: int, w: np.ndarray, steps: int) -> np.ndarray:
        """Site i's model after ``steps`` of gradient descent from ``w`` (exactly)."""
        q = self.basis[i]
        shrink = (1 - self.lr * self.eig[i]) ** steps
        moved: np.ndarray = self.opt[i] + q @ (shrink * (q.T @ (w - self.opt[i])))
        return moved

    def optimum_loss(self) -> float:
        """The federated loss's minimum (what no policy can beat)."""
        a = np.einsum("nij,nj,nkj->nik", self.basis, self.eig, self.basis)
        best = np.linalg.solve(a.sum(0), np.einsum("nij,nj->i", a, self.opt))
        return self.loss(best)

    def loss(self, w: np.ndarray) -> float:
        """The federated validation loss: the sites' population losses, averaged."""
        diff = np.einsum("nij,nj->ni", self.basis.transpose(0, 2, 1), w - self.opt)
        return float(np.mean(0.5 * np.sum(self.eig * diff ** 2, axis=1)))


@dataclass
class Setting:
    """What every policy shares: sites, timing, learning problem, the target."""

    sites: int
    steps: int  # the configured local steps
    step_s: np.ndarray  # each site's seconds per step
    startup_s: float
    scale: np.ndarray  # each site's queue-wait scale
    queue: QueueModel
    problem: Problem
    deadline: RoundDeadline
    quorum: int = 1
    aggregate_s: float = 5.0
    max_rounds: int = 400

    def job_seconds(self) -> float:
        """The median synchronous job: median wait + start-up + configured steps."""
        waits = [self.queue.median(s) for s in self.scale]
        return float(np.median(waits) + self.startup_s + self.steps * np.median(self.step_s))


@dataclass
class _Job:
    submitted: float
    arrives: float
    wait: float
    start_round: int
    start_w: np.ndarray
    steps: int


def _update(setting: Setting, w: np.ndarray, arrived: list[tuple[int, _Job]], rnd: int,
            staleness: StalenessSpec) -> np.ndarray:
    """w + sum_i m_i s(tau_i) Delta_i / sum_i m_i (equal data sizes m_i)."""
    if not arrived:
        return w
    step = np.zeros_like(w)
    for i, job in arrived:
        delta = setting.problem.local(i, job.start_w, job.steps) - job.start_w
        step += staleness.weight(rnd - job.start_round) * delta
    return w + step / len(arrived)


def run_policy(setting: Setting, policy: str, limit: float | None, target: float,
               seed: int) -> dict[str, Any]:
    """Simulate ``policy`` (sync, timeout with ``limit`` = T, queue_aware with ``limit`` = D)
    until the target loss or ``max_rounds``; the simulated seconds to target (None: never)."""
    rng = np.random.default_rng(seed)  # the same draws for every policy, site by site
    draws = [np.random.default_rng(rng.integers(2**63)) for _ in range(setting.sites)]
    prob, staleness = setting.problem, setting.deadline.staleness
    w = np.zeros_like(prob.opt[0])
    t, flight = 0.0, {}  # site -> its job in flight
    waits: list[list[float]] = [[] for _ in range(setting.sites)]
    deadline = setting.deadline.model_copy(update={"seconds": limit, "late": "adopt"}) \
        if limit else None
    lost = late = 0
    for rnd in range(1, setting.max_rounds + 1):
        for i in range(setting.sites):
            if i in flight:
                continue  # queue-aware: its late job is adopted, not submitted again
            steps = setting.steps
            if policy == "queue_aware" and deadline is not None:
                est = SiteEstimate(str(i), ewma(waits[i], ALPHA, setting.queue.median(
                    setting.scale[i])), setting.startup_s, float(setting.step_s[i]))
                steps = fit_steps(deadline, setting.steps, 4.0, est, setting.startup_s)
            wait = setting.queue.draw(draws[i], float(setting.scale[i]))
            flight[i] = _Job(t, t + wait + setting.startup_s + steps * setting.step_s[i],
                             wait, rnd, w, steps)
        times = sorted(j.arrives for j in flight.values())
        close = times[-1]
        if policy != "sync" and limit is not None:
            close = min(close, max(t + limit, times[min(setting.quorum, len(times)) - 1]
                                   if policy == "queue_aware" else t + limit))
        arrived = [(i, j) for i, j in flight.items() if j.arrives <= close]
        for i, job in arrived:
            waits[i].append(job.wait)
            del flight[i]
        if policy == "queue_aware":
            stale = [i for i, j in flight.items() if rnd - j.start_round >= staleness.max_rounds]
            for i in stale:  # too late to be admitted: dropped, the site starts afresh
                del flight[i]
            late += sum(1 for _, j in arrived if j.start_round < rnd)
            w = _update(setting, w, arrived, rnd, staleness)
        else:
            lost += len(flight)
            flight.clear()  # sync: none left; timeout: cancelled, work lost
            if len(arrived) >= setting.quorum:
                w = _update(setting, w, arrived, rnd, staleness)
        t = close + setting.aggregate_s
        loss = prob.loss(w)
        if loss <= target:
            return {"policy": policy, "limit_s": limit, "seconds": t, "rounds": rnd,
                    "loss": loss, "lost_jobs": lost, "late_updates": late}
    return {"policy": policy, "limit_s": limit, "seconds": None, "rounds": setting.max_rounds,
            "loss": prob.loss(w), "lost_jobs": lost, "late_updates": late}


def setting_for(sites: int, steps: int, deadline: RoundDeadline, queue: QueueModel, seed: int,
                step_s: float = 1.0, startup_s: float | None = None,
                quorum: int = 1) -> Setting:
    """The virtual sites of one seed: their speeds, queue scales and learning problem."""
    rng = np.random.default_rng([seed, 1])
    spread = math.log(queue.site_spread)
    return Setting(
        sites=sites, steps=steps, step_s=step_s * np.exp(rng.uniform(-0.7, 0.7, sites)),
        startup_s=deadline.startup if startup_s is None else startup_s,
        scale=np.exp(rng.uniform(-spread, spread, sites)), queue=queue,
        problem=Problem.make(sites, rng), deadline=deadline, quorum=quorum)


def default_target(setting: Setting, share: float = 0.05) -> float:
    """The loss ``share`` of the way back from the optimum to the initial model's (default:
    95 % of the possible improvement made)."""
    best = setting.problem.optimum_loss()
    return best + share * (setting.problem.loss(np.zeros_like(setting.problem.opt[0])) - best)


def compare(sites: int, steps: int, deadline: RoundDeadline, queue: QueueModel,
            seeds: list[int], target: float | None = None,
            step_s: float = 1.0) -> dict[str, Any]:
    """Every policy on every seed: the best timeout and deadline of the grid, by mean time."""
    runs: dict[str, list[dict[str, Any]]] = {}
    targets = []
    for seed in seeds:
        setting = setting_for(sites, steps, deadline, queue, seed, step_s)
        goal = default_target(setting) if target is None else target
        targets.append(goal)
        job = setting.job_seconds()
        runs.setdefault("sync", []).append(run_policy(setting, "sync", None, goal, seed))
        for factor in GRID:
            for policy in ("timeout", "queue_aware"):
                runs.setdefault(f"{policy}@{factor:g}", []).append(
                    run_policy(setting, policy, factor * job, goal, seed))
    def mean_hours(key: str) -> float:
        times = [r["seconds"] for r in runs[key]]
        return math.inf if None in times else float(np.mean(times)) / 3600
    best = {p: min((k for k in runs if k.startswith(p)), key=mean_hours)
            for p in ("timeout", "queue_aware")}
    table = {"sync": mean_hours("sync"), "timeout": mean_hours(best["timeout"]),
             "queue_aware": mean_hours(best["queue_aware"])}
    reference = min(table["sync"], table["timeout"])
    return {"sites": sites, "seeds": seeds, "targets": targets, "hours": table,
            "best": best, "grid": list(GRID),
            "sweep": {k: mean_hours(k) for k in runs},
            "saving_vs_best_timeout": None if not math.isfinite(reference) or reference == 0
            else 1 - table["queue_aware"] / reference, "runs": runs}
