"""The server strategies: one registry of names, default parameters, server state and steps.

A strategy is one class here, registered with :func:`register`: its ``name``, its
parameters (a pydantic model, :class:`StrategyParams`: one typed field with its default
each, as Flower's strategies take typed arguments), the server-state buffers it keeps
between rounds, whether it is robust (coordinate-wise over the stacked updates, unweighted)
or averaging (a step from the weighted FedAvg ``mean``), and that step. The job spec, the
command lines and the aggregator read this registry and nothing else; adding a strategy is
one class and its parameters' model.

The server optimizers follow Flower's ``flwr.server.strategy`` (FedAvgM, FedOpt and its
FedAdam/FedYogi/FedAdagrad subclasses, which implement Reddi et al. 2021, "Adaptive
Federated Optimization", without Adam's bias correction):

* pseudo-gradient ``delta = mean - x`` where ``mean`` is the weighted FedAvg of the updates
  and ``x`` the previous global;
* FedAdam / FedYogi / FedAdagrad: ``m = b1*m + (1-b1)*delta``; Adam ``v = b2*v +
  (1-b2)*delta^2``; Yogi ``v = v - (1-b2)*delta^2*sign(v - delta^2)``; Adagrad ``v = v +
  delta^2``; then ``x = x + eta*m / (sqrt(v) + tau)``. Flower's defaults: FedAdam eta=0.1,
  b1=0.9, b2=0.99, tau=1e-9; FedYogi eta=0.01, b1=0.9, b2=0.99, tau=1e-3; FedAdagrad
  eta=0.1, tau=1e-9 and b1=0 (so m = delta);
* FedAvgM: ``buf = momentum*buf + (x - mean)``; ``x = x - lr*buf``. Flower's defaults
  (lr=1.0, momentum=0.0) reduce it to FedAvg; we default to lr=1.0, momentum=0.9 (Hsu et
  al. 2019).

DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models", Algorithm 1): the outer gradient ``g = x - mean`` (the previous global
minus the weighted mean of the sites' weights after their inner AdamW steps) drives SGD with
Nesterov momentum as torch.optim.SGD(nesterov=True) computes it, which the paper's code uses:
``buf = momentum*buf + g``; ``x = x - lr*(g + momentum*buf)``; the paper's outer lr 0.7 and
momentum 0.9 are the defaults.

FedMedian and FedTrimmedAvg are coordinate-wise and unweighted, as in Flower: the median of
the updates, and the mean after dropping the ``int(beta*n)`` smallest and largest values of
each coordinate (Flower's default beta=0.2).

This module imports no numpy at import time (only a step needs it); the command line imports
it (and pydantic) only when it aggregates or draws its help.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from xffl.core.errors import InvalidInput

if TYPE_CHECKING:
    from xffl.aggregator.safetensors_io import Array

#: how updates are weighed in the averaging strategies (explicit site weights aside)
Weighting = Literal["samples", "tokens", "uniform"]
WEIGHTINGS: tuple[Weighting, ...] = ("samples", "tokens", "uniform")


class StrategyParams(BaseModel):
    """A strategy's parameters: one typed field with its default each, no other name."""

    model_config = ConfigDict(extra="forbid", frozen=True)


P = TypeVar("P")


class Strategy(Generic[P]):
    """A server strategy: how the coordinator turns a round's updates into the next global.

    ``Params`` is its parameters' model (``P``, the type :meth:`step` and :meth:`combine`
    get). Averaging strategies (``robust = False``) get the weighted FedAvg ``mean`` of a
    slice and return the new global's slice from :meth:`step`, keeping ``state`` (one
    float64 array per buffer in :attr:`state`, zeros at the first round) up to date in
    place. Robust ones return it from :meth:`combine` over the stacked, unweighted updates.
    """

    name: ClassVar[str]
    Params: ClassVar[type[StrategyParams]] = StrategyParams
    state: ClassVar[tuple[str, ...]] = ()
    robust: ClassVar[bool] = False
    summary: ClassVar[str] = ""

    @property
    def defaults(self) -> Mapping[str, float]:
        """Each parameter's default, by name, in the order of :attr:`Params`."""
        return MappingProxyType(self.Params().model_dump())

    @property
    def steps(self) -> bool:
        """Whether this averaging strategy takes a step from the previous global (it then
        needs that global), rather than publishing the weighted mean as it is."""
        return not self.robust and type(self).step is not Strategy.step

    @property
    def mean(self) -> bool:
        """Whether this strategy publishes the weighted FedAvg mean as it is (no step, not
        robust): the FedAvg engine (:func:`xffl.aggregator.fedavg.aggregate`) computes it."""
        return not self.robust and not self.steps

    def check_count(self, params: P, updates: int) -> None:
        """Refuse a round of ``updates`` updates this strategy cannot aggregate."""

    def step(self, params: P, x: Array, mean: Array,
             state: MutableMapping[str, Array]) -> Array:
        """The new global's slice from the previous one ``x`` and the updates' ``mean``."""
        return mean

    def combine(self, params: P, stack: Array) -> Array:
        """Robust strategies: the new global's slice from the stacked updates (axis 0)."""
        raise NotImplementedError(f"{self.name} is not a robust strategy")


S = TypeVar("S", bound=type[Strategy[Any]])
STRATEGIES: dict[str, Strategy[Any]] = {}


def register(cls: S) -> S:
    """Add a strategy class to the registry (its one instance), under its ``name``."""
    if cls.name in STRATEGIES:
        raise ValueError(f"strategy {cls.name!r} is registered twice")
    STRATEGIES[cls.name] = cls()
    return cls


def names() -> tuple[str, ...]:
    """Every registered strategy's name, in registration order."""
    return tuple(STRATEGIES)


def get(name: str) -> Strategy[Any]:
    """The strategy called ``name``; InvalidInput naming the known ones otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise InvalidInput(f"unknown strategy {name!r}; use one of {', '.join(names())}.") \
            from None


def resolve_params(name: str, params: Mapping[str, float] | None) -> StrategyParams:
    """The strategy's parameters: its defaults overridden by ``params`` (InvalidInput on an
    unknown name or a value it cannot work with)."""
    strategy = get(name)
    model = strategy.Params
    try:
        return model.model_validate({k: float(v) for k, v in (params or {}).items()})
    except ValidationError as exc:
        error = exc.errors()[0]
        key = error["loc"][0] if error["loc"] else ""
        if error["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields) or "none"
            raise InvalidInput(f"strategy {name} has no parameter {key!r} (it has: "
                               f"{known}).") from None
        raise InvalidInput(f"{error['msg'].removeprefix('Value error, ')}.") from None


def _at_least(name: str, key: str, value: float, low: float, high: float | None = None,
              closed: bool = True) -> float:
    """``value`` when in [low, high) (or > low, ``closed`` False); ValueError otherwise."""
    ok = (value >= low if closed else value > low) and (high is None or value < high)
    if not ok:
        where = f"[{low:g}, {high:g})" if high is not None else f"> {low:g}"
        raise ValueError(f"{name} {key} must be {'in ' if high is not None else ''}{where}, "
                         f"got {value}")
    return value


class FedAvgParams(StrategyParams):
    """FedAvg takes no parameters."""


@register
class FedAvg(Strategy[FedAvgParams]):
    """The weighted mean of the updates."""

    name = "fedavg"
    Params = FedAvgParams
    summary = "weighted mean of the updates"


class FedAvgMParams(StrategyParams):
    """FedAvgM's server learning rate and momentum."""

    server_learning_rate: float = 1.0
    server_momentum: float = 0.9


@register
class FedAvgM(Strategy[FedAvgMParams]):
    """FedAvg with server momentum (Hsu et al. 2019)."""

    name = "fedavgm"
    Params = FedAvgMParams
    state = ("momentum",)
    summary = "FedAvg with server momentum"

    def step(self, params: FedAvgMParams, x: Array, mean: Array,
             state: MutableMapping[str, Array]) -> Array:
        """``buf = momentum*buf + (x - mean)``; ``x - lr*buf``."""
        buf = state["momentum"]
        buf *= params.server_momentum
        buf += x - mean
        result: Array = x - params.server_learning_rate * buf
        return result


class _Moments(Protocol):
    """What every adaptive server optimizer's parameters hold."""

    eta: float  # the server learning rate
    beta_1: float  # the first moment's decay
    tau: float  # the adaptivity (added to sqrt(v))


M = TypeVar("M", bound=_Moments)


class _FedOpt(Strategy[M]):
    """Reddi et al.'s adaptive server optimizers: first moment, then each its second."""

    state = ("m", "v")

    def second_moment(self, params: M, v: Array, d2: Array) -> None:
        """Update ``v`` in place from the squared pseudo-gradient ``d2``."""
        raise NotImplementedError

    def step(self, params: M, x: Array, mean: Array,
             state: MutableMapping[str, Array]) -> Array:
        """``m = b1*m + (1-b1)*delta``; v by the subclass; ``x + eta*m/(sqrt(v)+tau)``."""
        import numpy as np

        delta = mean - x
        m, v = state["m"], state["v"]
        m *= params.beta_1
        m += (1.0 - params.beta_1) * delta
        self.second_moment(params, v, delta * delta)
        result: Array = x + params.eta * m / (np.sqrt(v) + params.tau)
        return result


class FedAdamParams(StrategyParams):
    """FedAdam's parameters (Flower's defaults)."""

    eta: float = 1e-1
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-9


@register
class FedAdam(_FedOpt[FedAdamParams]):
    """Adam on the server (Reddi et al. 2021)."""

    name = "fedadam"
    Params = FedAdamParams
    summary = "Adam server optimizer"

    def second_moment(self, params: FedAdamParams, v: Array, d2: Array) -> None:
        """``v = b2*v + (1-b2)*delta^2``."""
        v *= params.beta_2
        v += (1.0 - params.beta_2) * d2


class FedYogiParams(StrategyParams):
    """FedYogi's parameters (Flower's defaults)."""

    eta: float = 1e-2
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3


@register
class FedYogi(_FedOpt[FedYogiParams]):
    """Yogi on the server (Reddi et al. 2021)."""

    name = "fedyogi"
    Params = FedYogiParams
    summary = "Yogi server optimizer"

    def second_moment(self, params: FedYogiParams, v: Array, d2: Array) -> None:
        """``v = v - (1-b2)*delta^2*sign(v - delta^2)``."""
        import numpy as np

        v -= (1.0 - params.beta_2) * d2 * np.sign(v - d2)


class FedAdagradParams(StrategyParams):
    """FedAdagrad's parameters (Flower's defaults; no first-moment decay)."""

    eta: float = 1e-1
    beta_1: float = 0.0
    tau: float = 1e-9


@register
class FedAdagrad(_FedOpt[FedAdagradParams]):
    """Adagrad on the server (Reddi et al. 2021)."""

    name = "fedadagrad"
    Params = FedAdagradParams
    summary = "Adagrad server optimizer"

    def second_moment(self, params: FedAdagradParams, v: Array, d2: Array) -> None:
        """``v = v + delta^2``."""
        v += d2


class DiLoCoParams(StrategyParams):
    """DiLoCo's outer learning rate (> 0) and Nesterov momentum (in [0, 1))."""

    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @field_validator("outer_lr")
    @classmethod
    def _lr(cls, value: float) -> float:
        return _at_least("diloco", "outer_lr", value, 0, closed=False)

    @field_validator("outer_momentum")
    @classmethod
    def _momentum(cls, value: float) -> float:
        return _at_least("diloco", "outer_momentum", value, 0, 1)


@register
class DiLoCo(Strategy[DiLoCoParams]):
    """DiLoCo's outer optimizer: SGD with Nesterov momentum on the outer gradient."""

    name = "diloco"
    Params = DiLoCoParams
    state = ("momentum",)
    summary = "DiLoCo outer step: Nesterov SGD on the pseudo-gradient"

    def step(self, params: DiLoCoParams, x: Array, mean: Array,
             state: MutableMapping[str, Array]) -> Array:
        """``g = x - mean``; ``buf = mu*buf + g``; ``x - lr*(g + mu*buf)``."""
        mu = params.outer_momentum
        g = x - mean
        buf = state["momentum"]
        buf *= mu
        buf += g
        result: Array = x - params.outer_lr * (g + mu * buf)
        return result


class FedMedianParams(StrategyParams):
    """FedMedian takes no parameters."""


@register
class FedMedian(Strategy[FedMedianParams]):
    """The coordinate-wise median (unweighted)."""

    name = "fedmedian"
    Params = FedMedianParams
    robust = True
    summary = "coordinate-wise median (robust)"

    def combine(self, params: FedMedianParams, stack: Array) -> Array:
        """The median over axis 0."""
        import numpy as np

        median: Array = np.median(stack, axis=0)
        return median


class FedTrimmedAvgParams(StrategyParams):
    """The fraction trimmed at each end, in [0, 0.5) (Flower's default 0.2)."""

    beta: float = 0.2

    @field_validator("beta")
    @classmethod
    def _beta(cls, value: float) -> float:
        return _at_least("fedtrimmedavg", "beta", value, 0, 0.5)


@register
class FedTrimmedAvg(Strategy[FedTrimmedAvgParams]):
    """The coordinate-wise mean after trimming the ``beta`` fraction at both ends."""

    name = "fedtrimmedavg"
    Params = FedTrimmedAvgParams
    robust = True
    summary = "coordinate-wise trimmed mean (robust)"

    def check_count(self, params: FedTrimmedAvgParams, updates: int) -> None:
        """At least one update must survive the trimming."""
        if updates - 2 * int(params.beta * updates) < 1:
            raise InvalidInput(f"beta={params.beta} trims all {updates} updates.")

    def combine(self, params: FedTrimmedAvgParams, stack: Array) -> Array:
        """The mean over axis 0 without the int(beta*n) smallest and largest values."""
        import numpy as np

        n = stack.shape[0]
        cut = int(params.beta * n)
        trimmed: Array = np.sort(stack, axis=0)[cut : n - cut].mean(axis=0)
        return trimmed
