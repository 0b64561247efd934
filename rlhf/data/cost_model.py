"""A measured cost model of packed micro-batches: time and peak memory as a function of a
micro-batch's shape, per pipeline stage, for one role and phase (DynaPipe's cost model).

A shape is four numbers of the packed sequences' lengths l_i: tokens (sum l_i), seqs (their
count), sum_sq (sum l_i^2: attention's work) and max_sq (max l_i^2: the largest attention
block alive at once). Time and memory are linear in them with non-negative coefficients,
fitted by least squares on residuals relative to the fit (`fit_nonnegative`) from a timed grid that
`rlhf profile` runs on the role's real layout (rlhf.plan.profile). The file it writes holds
one `RoleCost` per role with the fingerprint of what it was measured on; a changed model,
layout, dtype, recompute, machine or torch version means a new profile (`CostModelFile`).
Pure logic: no tensors, no processes; the driver's planner (rlhf.data.micro_batching) reads it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSION = 2  # 2: the reweighted fit and the in-pipeline message cost
SHAPE_FEATURES = ("tokens", "seqs", "sum_sq", "max_sq")
# A constant (per micro-batch overhead: kernel launches, the head's fixed work) comes first.
TIME_FEATURES = ("const", "tokens", "seqs", "sum_sq")
MEMORY_FEATURES = ("const", "tokens", "sum_sq", "max_sq")
PHASES = ("forward", "forward_backward")


@dataclass(frozen=True)
class Shape:
    """What the cost model reads of a packed micro-batch (see the module docstring)."""

    tokens: int
    seqs: int
    sum_sq: int
    max_sq: int

    @classmethod
    def of(cls, lengths: Sequence[int]) -> Shape:
        return cls(sum(lengths), len(lengths), sum(n * n for n in lengths),
                   max((n * n for n in lengths), default=0))

    def __add__(self, other: Shape) -> Shape:
        return Shape(self.tokens + other.tokens, self.seqs + other.seqs,
                     self.sum_sq + other.sum_sq, max(self.max_sq, other.max_sq))

    def feature(self, name: str) -> float:
        return 1.0 if name == "const" else float(getattr(self, name))


EMPTY = Shape(0, 0, 0, 0)


def linear(coefs: Mapping[str, float], shape: Shape) -> float:
    """sum of coefficient * feature over the coefficients' features."""
    return sum(c * shape.feature(name) for name, c in coefs.items())


def fit_nonnegative(shapes: Sequence[Shape], targets: Sequence[float],
                    features: Sequence[str], *, rounds: int = 3) -> dict[str, float]:
    """Non-negative coefficients of `features` minimising the squared error relative to the
    fitted values over the measurements: exact per round, by solving every subset of free
    features (at most 2^4 systems). Round one divides by the measured values, which weighs a
    slow (preempted) run less than a fast one and so fits low; later rounds divide by the
    previous round's fit instead, which fits the mean time (`rounds` 1: the plain relative fit)."""
    if len(shapes) != len(targets) or not shapes:
        raise ValueError(f"need as many measurements as shapes, got {len(shapes)} shapes and "
                         f"{len(targets)} targets")
    y = np.asarray(targets, dtype=np.float64)
    if (y <= 0).any():
        raise ValueError("every measured target must be positive")
    raw = np.array([[s.feature(f) for f in features] for s in shapes])
    coefs: dict[str, float] = {}
    weight = y
    for _ in range(rounds):
        coefs = _fit_round(raw, y, weight, features)
        fitted = raw @ np.array([coefs[f] for f in features])
        if (fitted <= 0).any():
            break  # a zero fit somewhere: no better weight than the measurement there
        weight = fitted
    return coefs


def _fit_round(raw: np.ndarray, y: np.ndarray, weight: np.ndarray,
               features: Sequence[str]) -> dict[str, float]:
    """The non-negative least squares of (raw @ c - y) / weight, over every feature subset."""
    x = raw / weight[:, None]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    x = x / scale
    target = y / weight
    best: tuple[float, dict[str, float]] | None = None
    for k in range(len(features), 0, -1):
        for subset in itertools.combinations(range(len(features)), k):
            cols = list(subset)
            sol, *_ = np.linalg.lstsq(x[:, cols], target, rcond=None)
            if (sol < 0).any():
                continue
            err = float(((x[:, cols] @ sol - target) ** 2).sum())
            if best is None or err < best[0] - 1e-15:
                coefs = dict.fromkeys(features, 0.0)
                for c, v in zip(cols, sol):
                    coefs[features[c]] = float(v / scale[c])
                best = (err, coefs)
    assert best is not None  # a single non-negative column always solves with sol >= 0
    return best[1]


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage's seconds and peak bytes of one micro-batch (the whole model at pp 1)."""

    time: Mapping[str, float]
    memory: Mapping[str, float]


@dataclass(frozen=True)
class PhaseCost:
    """A role's forward or forward+backward pass, per pipeline stage, and the p2p of a
    micro-batch's activation between two stages (seconds: const + per token)."""

    stages: tuple[StageCost, ...]
    p2p: Mapping[str, float]

    @property
    def pp(self) -> int:
        return len(self.stages)

    def stage_times(self, shape: Shape) -> list[float]:
        return [linear(s.time, shape) for s in self.stages]

    def time(self, shape: Shape) -> float:
        """Seconds of one micro-batch through all stages, one after another (its p2p included)."""
        return sum(self.stage_times(shape)) + (self.pp - 1) * self.p2p_time(shape)

    def bottleneck(self, shape: Shape) -> float:
        """Seconds of the slowest stage on this micro-batch: a pipeline's steady-state pace."""
        return max(self.stage_times(shape))

    def p2p_time(self, shape: Shape) -> float:
        return linear(self.p2p, shape) if self.pp > 1 else 0.0

    def memory(self, shape: Shape) -> float:
        """Peak bytes of one micro-batch on the stage that needs the most."""
        return max(linear(s.memory, shape) for s in self.stages)

    def marginal_time(self, shape: Shape) -> float:
        """What a sample adds to its micro-batch's time: the time without the constant."""
        return sum(linear({k: v for k, v in s.time.items() if k != "const"}, shape)
                   for s in self.stages)

    def to_json(self) -> dict:
        return {"stages": [{"time": dict(s.time), "memory": dict(s.memory)} for s in self.stages],
                "p2p": dict(self.p2p)}

    @classmethod
    def from_json(cls, d: Mapping) -> PhaseCost:
        return cls(tuple(StageCost(dict(s["time"]), dict(s["memory"])) for s in d["stages"]),
                   dict(d.get("p2p", {})))


@dataclass(frozen=True)
class RoleCost:
    """The cost of one role per phase, and the fingerprint of what it was measured on."""

    fingerprint: Mapping
    phases: Mapping[str, PhaseCost]
    fit: Mapping = None  # type: ignore[assignment]  # per phase: the fit's relative errors

    def phase(self, name: str) -> PhaseCost:
        if name not in self.phases:
            raise ValueError(f"the cost model has no {name!r} phase for this role (it has "
                             f"{sorted(self.phases)}); run `rlhf profile` on the config again")
        return self.phases[name]

    def to_json(self) -> dict:
        return {"fingerprint": dict(self.fingerprint), "digest": digest(self.fingerprint),
                "phases": {k: v.to_json() for k, v in self.phases.items()},
                "fit": dict(self.fit or {})}

    @classmethod
    def from_json(cls, d: Mapping) -> RoleCost:
        return cls(dict(d["fingerprint"]),
                   {k: PhaseCost.from_json(v) for k, v in d["phases"].items()},
                   dict(d.get("fit", {})))


def digest(fingerprint: Mapping) -> str:
    """A short stable hash of a fingerprint (sorted JSON)."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CostModelFile:
    """The JSON file `rlhf profile` writes: {"version", "roles": {role key: RoleCost}}."""

    def __init__(self, roles: Mapping[str, RoleCost] | None = None):
        self.roles: dict[str, RoleCost] = dict(roles or {})

    @classmethod
    def load(cls, path: str | Path) -> CostModelFile:
        path = Path(path)
        if not path.is_file():
            return cls()
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            return cls()  # an older format: profile again
        return cls({k: RoleCost.from_json(v) for k, v in data["roles"].items()})

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"version": VERSION,
                                   "roles": {k: v.to_json() for k, v in self.roles.items()}},
                                  indent=1, sort_keys=True))
        tmp.replace(path)

    def matching(self, key: str, fingerprint: Mapping) -> RoleCost | None:
        """The role's cost model when it was measured on `fingerprint`, else None."""
        role = self.roles.get(key)
        if role is None or digest(role.fingerprint) != digest(fingerprint):
            return None
        return role

    def require(self, key: str, fingerprint: Mapping, *, path: str | Path) -> RoleCost:
        """`matching`, or a ValueError saying what changed and how to re-profile."""
        role = self.matching(key, fingerprint)
        if role is not None:
            return role
        if not self.roles:
            raise ValueError(f"no cost model at {path} (missing, or written by another "
                             "version); run `rlhf profile CONFIG` first (or set "
                             "trainer.micro_batching=token_budget)")
        if key not in self.roles:
            raise ValueError(f"{path} has no cost model of role {key!r}; run `rlhf profile "
                             "CONFIG` first (or set trainer.micro_batching=token_budget)")
        old = self.roles[key].fingerprint
        changed = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
        raise ValueError(f"the cost model of role {key!r} in {path} was measured on another "
                         f"setup ({', '.join(changed)} changed); run `rlhf profile CONFIG` again")
