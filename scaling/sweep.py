"""Scaling-law sweeps: a spec -> points -> training runs -> a results store.

A spec (configs/sweeps/*.yaml) names a base experiment config, a model family (shape from
one size knob, the depth L), either a grid (depths x token budgets) or IsoFLOP (compute
budgets x depths, tokens = C / FLOPs-per-token), per-size hyperparameter rules, and seeds.
Each point is an ordinary training run in DIR/points/<point-id>/ (one process each,
scaling.executors); each result lands in DIR/results.sqlite, table `points`, one
transaction per update (WAL), so the store survives a crash at any moment. A re-run skips
finished points and resumes the others from their checkpoints.

    python -m scaling sweep --config configs/sweeps/tiny_cpu.yaml [--out DIR] [--dry-run]
        [--workers K] [--executor local|submitit] [--only GLOB] [--spec.key=value ...]

The runner never starts a JAX backend (it imports jax's modules, through scaling.accounting
and scaling.hardware, but touches no device): on a GPU machine a backend would claim
memory the points need.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import fnmatch
import hashlib
import math
import re
import os
import signal
import sqlite3
import sys
import time
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import draccus
import yaml

from scaling import accounting
from scaling.config import (
    Config,
    ConfigError,
    DataSource,
    StrEnum,
    _deep_merge,
    _Loader,
    _read_yaml,
    config_from_dict,
    dump_yaml,
    parse_overrides,
)


class SpecError(ConfigError):
    """A sweep spec key is unknown, mistyped or impossible. The message names the key."""


# ------------------------------------------------------------------------ the spec


class ScaleBy(StrEnum):
    params = "params"  # N, the exact parameter count
    tokens = "tokens"  # D, the point's token target
    flops = "flops"  # C, the point's compute target


@dataclasses.dataclass(frozen=True)
class PowerRule:
    """value = base * (x / ref) ** exponent, x the point's N, D or C (`of`); then clamped
    to [min, max] and, for integer settings, rounded to a multiple of `multiple_of` inside it.

    A learning rate that falls with size is a negative exponent: lr = 3e-3 (N / 1e6)^-0.5.
    """

    base: float
    ref: float = 1.0
    exponent: float = 0.0
    of: ScaleBy = ScaleBy.params
    min: float | None = None
    max: float | None = None
    multiple_of: int = 1

    def value(self, x: float) -> float:
        v = self.base * (x / self.ref) ** self.exponent
        if self.min is not None:
            v = max(v, self.min)
        if self.max is not None:
            v = min(v, self.max)
        return v

    def integer(self, x: float) -> int:
        """value(x) rounded to a multiple of `multiple_of`, kept within [min, max]: rounding
        a clamped value can step past the clamp (max 12, multiple_of 8 rounded 12 to 16).
        validate_spec refuses a rule with no multiple inside its clamps."""
        m = self.multiple_of
        lo, hi = self._multiples_within()
        return int(min(max(round(self.value(x) / m) * m, lo), hi))

    def _multiples_within(self) -> tuple[int, float]:
        """The smallest and largest multiples of `multiple_of` (at least one) inside [min, max]."""
        m = self.multiple_of
        lo = m * max(1, math.ceil(self.min / m)) if self.min is not None else m
        hi = m * math.floor(self.max / m) if self.max is not None else math.inf
        return lo, hi


@dataclasses.dataclass(frozen=True)
class BaseSpec:
    config: str | None = None  # experiment config YAML, relative to the spec file
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # nested, like a config file


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """Model shape from the depth L at a fixed aspect ratio (Kaplan et al. 2020, sec. 3.1:
    loss depends weakly on shape at fixed N, so one knob suffices):
    D = aspect * L; H fixed, N = D / H query heads; K = N / kv_ratio; F = mlp_ratio * D
    rounded up to a multiple of mlp_multiple (SwiGLU's 8/3 keeps 3*D*F ~ 8*D^2, the
    parameter count of a 4*D GELU MLP; Shazeer 2020)."""

    aspect: int = 64
    head_dim: int = 64
    kv_ratio: int = 1  # 1 is MHA
    mlp_ratio: float = 8 / 3
    mlp_multiple: int = 64

    def model(self, depth: int) -> dict[str, int]:
        d = self.aspect * depth
        if d % self.head_dim:
            raise SpecError(f"family.head_dim: width {d} (aspect {self.aspect} x depth {depth}) is not a multiple of head_dim={self.head_dim}")
        heads = d // self.head_dim
        if heads % self.kv_ratio:
            raise SpecError(f"family.kv_ratio: {heads} heads at depth {depth} are not divisible by kv_ratio={self.kv_ratio}")
        mlp = int(math.ceil(self.mlp_ratio * d / self.mlp_multiple)) * self.mlp_multiple
        return {
            "num_layers": depth,
            "hidden_size": d,
            "num_heads": heads,
            "num_kv_heads": heads // self.kv_ratio,
            "head_dim": self.head_dim,
            "mlp_dim": mlp,
        }


@dataclasses.dataclass(frozen=True)
class GridSpec:
    tokens: tuple[float, ...] = ()  # token budgets D; every depth trains on each


@dataclasses.dataclass(frozen=True)
class IsoFlopSpec:
    budgets: tuple[float, ...] = ()  # compute budgets C in training FLOPs
    min_steps: int = 1  # points that would train for fewer steps are dropped (and listed)


@dataclasses.dataclass(frozen=True)
class HParamsSpec:
    """Settings that must scale with the point; unset ones keep the base config's value."""

    learning_rate: PowerRule | None = None
    batch_size: PowerRule | None = None  # sequences per step
    warmup_fraction: float | None = None  # warmup = max(warmup_min, round(fraction * steps))
    warmup_min: int = 0


@dataclasses.dataclass(frozen=True)
class EstimateSpec:
    """Assumptions behind --dry-run's predicted time (each overridable on the command line).

    time per point = startup_s + steps * step_overhead_s + FLOPs / throughput, throughput
    being tokens_per_sec if set, else mfu * the hardware's peak bf16 FLOP/s. Small models
    are launch-bound, not FLOP-bound: step_overhead_s is that floor per step.
    """

    hardware: str = "h100"
    mfu: float = 0.3
    tokens_per_sec: float | None = None
    startup_s: float = 30.0  # interpreter + JAX import + compile + data load, per point
    step_overhead_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    name: str = "sweep"
    base: BaseSpec = dataclasses.field(default_factory=BaseSpec)
    family: FamilySpec = dataclasses.field(default_factory=FamilySpec)
    depths: tuple[int, ...] = ()  # the size knob: one model per depth L
    grid: GridSpec | None = None
    isoflop: IsoFlopSpec | None = None
    hparams: HParamsSpec = dataclasses.field(default_factory=HParamsSpec)
    seeds: tuple[int, ...] = (0,)
    # point-id glob -> config deltas for those points only (e.g. a smaller batch for one)
    point_overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    estimate: EstimateSpec = dataclasses.field(default_factory=EstimateSpec)
    submitit: dict[str, Any] = dataclasses.field(default_factory=dict)  # update_parameters(**)


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside `X` or `X | None`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if inner else None
    return None


def _check_spec_keys(cls: type, data: Any, prefix: str = "") -> None:
    if not isinstance(data, Mapping):
        raise SpecError(f"{prefix.rstrip('.') or 'the spec'} must be a mapping of its fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in hints:
            raise SpecError(
                f"unknown sweep spec key {prefix + str(key)!r}; allowed keys under "
                f"{prefix.rstrip('.') or 'the top level'}: {', '.join(hints)}"
            )
        sub = _dataclass_of(hints[key])
        if sub is not None and value is not None:
            _check_spec_keys(sub, value, f"{prefix}{key}.")
        if typing.get_origin(hints[key]) is dict and value is not None:  # (draccus: "'int' object has no attribute 'items'")
            _check_mapping(hints[key], value, f"{prefix}{key}")
        # draccus iterates a scalar: `budgets: 1e9` (YAML reads a string) said "budgets.1: 'e'"
        if typing.get_origin(hints[key]) is tuple and value is not None and not isinstance(value, (list, tuple)):
            raise SpecError(f"{prefix}{key}: must be a list, e.g. [{value}], got {type(value).__name__} {value!r}")
        enum_cls = hints[key] if isinstance(hints[key], type) and issubclass(hints[key], StrEnum) else None
        allowed = [m.value for m in enum_cls] if enum_cls is not None else []
        if enum_cls is not None and value is not None and str(value) not in allowed:
            raise SpecError(f"{prefix}{key}: unknown value {value!r}; allowed: {', '.join(allowed)}")


def _check_mapping(tp: Any, value: Any, where: str) -> None:
    """`value` must be a mapping; for a dict of dicts (point_overrides), each entry too."""
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: must be a mapping, got {value!r}")
    if typing.get_origin(typing.get_args(tp)[1]) is dict:
        for k, v in value.items():
            if not isinstance(v, Mapping):
                raise SpecError(f"{where}.{k}: must be a mapping of config deltas, got {v!r}")


def _decode(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """draccus.decode, with errors naming the full dotted key (draccus loses it inside
    an optional sub-spec: "could not decode into any of the given types")."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        sub = _dataclass_of(hints[key])
        if sub is not None and isinstance(value, Mapping):
            _decode(sub, value, f"{prefix}{key}.")
    try:
        return draccus.decode(cls, dict(data))
    except Exception as e:  # draccus.utils.DecodingError names the key as `a.b`
        msg = str(e).replace("`", f"`{prefix}", 1) if str(e).startswith("`") else str(e)
        raise SpecError(f"invalid sweep spec value: {msg}") from None


def spec_from_dict(data: Mapping[str, Any]) -> SweepSpec:
    _check_spec_keys(SweepSpec, data)
    spec = _decode(SweepSpec, data)
    validate_spec(spec)
    return spec


def validate_spec(spec: SweepSpec) -> None:
    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise SpecError(f"{key}: {message}")

    require(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.name)), "name",
            f"{spec.name!r} must be letters, digits, '.', '_' or '-' (it names the output folder sweeps/<name>)")
    require((spec.grid is None) != (spec.isoflop is None), "grid/isoflop", "set exactly one of `grid` (depths x tokens) or `isoflop` (budgets x depths)")
    require(len(spec.depths) > 0 and all(d > 0 for d in spec.depths), "depths", f"must be a non-empty list of positive depths, got {list(spec.depths)}")
    require(len(set(spec.depths)) == len(spec.depths), "depths", f"has duplicates: {list(spec.depths)}")
    require(len(spec.seeds) > 0, "seeds", "must name at least one seed")
    # Point ids are `C<budget>-L<depth>-s<seed>` / `D<tokens>-...` with 3 significant digits;
    # two points with one id would share a run dir (and a store row).
    require(len(set(spec.seeds)) == len(spec.seeds), "seeds", f"has duplicates: {list(spec.seeds)}")
    require(all(s >= 0 for s in spec.seeds), "seeds", f"must be >= 0 (numpy and jax.random seeds), got {list(spec.seeds)}")

    def distinct_ids(key: str, kind: str, values: Sequence[float]) -> None:
        seen: dict[str, float] = {}
        for v in values:
            tag = _fmt(v)
            require(tag not in seen, key, f"{seen.get(tag, 0.0):g} and {v:g} give the same point id prefix {kind}{tag} "
                    "(ids keep 3 significant digits); make them differ in the first three digits")
            seen[tag] = v

    if spec.grid is not None:
        require(len(spec.grid.tokens) > 0 and all(_positive(t) for t in spec.grid.tokens), "grid.tokens", f"must be positive finite token budgets, got {list(spec.grid.tokens)}")
        distinct_ids("grid.tokens", "D", spec.grid.tokens)
    if spec.isoflop is not None:
        require(len(spec.isoflop.budgets) > 0 and all(_positive(c) for c in spec.isoflop.budgets), "isoflop.budgets", f"must be positive finite FLOP budgets, got {list(spec.isoflop.budgets)}")
        distinct_ids("isoflop.budgets", "C", spec.isoflop.budgets)
        require(spec.isoflop.min_steps >= 1, "isoflop.min_steps", f"must be >= 1, got {spec.isoflop.min_steps}")
    f = spec.family
    for name in ("aspect", "head_dim", "kv_ratio", "mlp_multiple"):
        require(getattr(f, name) > 0, f"family.{name}", f"must be positive, got {getattr(f, name)}")
    require(_positive(f.mlp_ratio), "family.mlp_ratio", f"must be positive and finite, got {f.mlp_ratio}")
    for name in ("learning_rate", "batch_size"):
        rule = getattr(spec.hparams, name)
        if rule is not None:
            require(_positive(rule.base) and _positive(rule.ref), f"hparams.{name}", f"base and ref must be positive and finite, got base={rule.base}, ref={rule.ref}")
            require(math.isfinite(rule.exponent), f"hparams.{name}.exponent", f"must be finite, got {rule.exponent}")
            require(rule.multiple_of >= 1, f"hparams.{name}.multiple_of", f"must be >= 1, got {rule.multiple_of}")
            for bound in ("min", "max"):
                v = getattr(rule, bound)
                require(v is None or _positive(v), f"hparams.{name}.{bound}", f"must be positive and finite (or unset), got {v}")
            require(rule.min is None or rule.max is None or rule.min <= rule.max, f"hparams.{name}",
                    f"min must be <= max, got min={rule.min}, max={rule.max}")
    rule = spec.hparams.batch_size
    if rule is not None:  # whole multiples of multiple_of: one must lie inside the clamps
        lo, hi = rule._multiples_within()
        clamps = ", ".join(f"{k}={v:g}" for k, v in (("min", rule.min), ("max", rule.max)) if v is not None)
        require(lo <= hi, "hparams.batch_size", f"batches are whole multiples of multiple_of={rule.multiple_of} "
                f"(at least one), and none lies within {clamps}")
    wf = spec.hparams.warmup_fraction
    require(wf is None or 0 <= wf < 1, "hparams.warmup_fraction", f"must be in [0, 1), got {wf}")
    require(spec.hparams.warmup_min >= 0, "hparams.warmup_min", f"must be >= 0 steps, got {spec.hparams.warmup_min}")
    # (without a fraction the base config's warmup_steps is kept: the minimum would do nothing)
    require(wf is not None or spec.hparams.warmup_min == 0, "hparams.warmup_min",
            "only applies with hparams.warmup_fraction (warmup = max(warmup_min, fraction * steps)); set both or neither")
    e = spec.estimate
    require(0 < e.mfu <= 1, "estimate.mfu", f"must be a fraction of peak in (0, 1], got {e.mfu}")
    for name in ("startup_s", "step_overhead_s"):
        v = getattr(e, name)
        require(math.isfinite(v) and v >= 0, f"estimate.{name}", f"must be >= 0 seconds (and finite), got {v}")
    require(e.tokens_per_sec is None or _positive(e.tokens_per_sec), "estimate.tokens_per_sec", f"must be positive and finite, got {e.tokens_per_sec}")
    from scaling.hardware import get_hardware  # (imports jax; no backend, no device memory)

    try:
        get_hardware(e.hardware)
    except ValueError as err:
        require(False, "estimate.hardware", str(err))
    for pattern, delta in spec.point_overrides.items():
        require(isinstance(delta, Mapping), f"point_overrides.{pattern}", f"must be a mapping of config deltas, got {delta!r}")


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def load_spec(path: str | os.PathLike, overrides: Sequence[str] = ()) -> tuple[SweepSpec, Path]:
    """The spec at `path` with dotted overrides (`--isoflop.budgets=[1e12]`); and its folder."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"sweep spec not found: {path}")
    try:  # (the configs' loader: a key repeated in the spec is an error, not the last one silently)
        with open(path, "rb") as f:
            data = yaml.load(f, Loader=_Loader) or {}
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    data = _deep_merge(data, parse_overrides(overrides, SweepSpec))
    try:
        return spec_from_dict(data), path.resolve().parent
    except SpecError as e:
        raise SpecError(f"{path}: {e}") from None


# ------------------------------------------------------------------------ points


@dataclasses.dataclass(frozen=True)
class Point:
    id: str
    depth: int
    seed: int
    cfg: Config
    n_params: int  # exact, accounting.param_count
    n_params_nonembedding: int  # without the embedding table and the output head (Kaplan's N)
    tokens: int  # D actually trained on: steps * batch * seq_len
    flops_per_token: float  # accounting.flops_per_token(...).total, training
    flops: float  # C actually used: tokens * flops_per_token
    target: float  # the budget asked for: C (IsoFLOP) or D (grid)
    # Why this point cannot run (its point_overrides make an invalid config); `cfg` is
    # then the config without them. The runner records it as failed; the others run.
    error: str | None = None

    @property
    def steps(self) -> int:
        return self.cfg.train.steps

    @property
    def config_hash(self) -> str:
        return hashlib.sha256(dump_yaml(self.cfg).encode()).hexdigest()[:16]


def _fmt(x: float) -> str:
    """1e15 -> '1e15', 3e14 -> '3e14', 2.5e9 -> '2.5e9': short and filename-safe."""
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant.rstrip('0').rstrip('.')}e{int(exp)}"


def _point_config(spec: SweepSpec, base: dict, depth: int, seed: int, pid: str, train: dict, optimizer: dict) -> tuple[Config, str | None]:
    """The point's config, and the error its point_overrides cause (then without them)."""
    data = _deep_merge(base, {"model": spec.family.model(depth), "train": {**train, "seed": seed}, "optimizer": optimizer})
    data = _deep_merge(data, {"logging": {"progress": False}})  # the child's stdout is a log file
    try:
        plain = config_from_dict(data)
    except ConfigError as e:
        raise SpecError(f"point {pid} (depth {depth}): {e}") from None
    for pattern, delta in spec.point_overrides.items():
        if fnmatch.fnmatchcase(pid, pattern):
            data = _deep_merge(data, delta)
    try:
        return config_from_dict(data), None
    except ConfigError as e:
        return plain, f"point_overrides make an invalid config: {e}"


def base_config_dict(spec: SweepSpec, spec_dir: Path) -> dict:
    try:
        data = _read_yaml(spec_dir / spec.base.config) if spec.base.config else {}
    except ConfigError as e:  # (said "config file not found: <path>", not which spec key)
        raise SpecError(f"base.config: {e}") from None
    return _deep_merge(data, spec.base.overrides)


def generate_points(spec: SweepSpec, spec_dir: Path) -> tuple[list[Point], list[str]]:
    """All points of the sweep, and a note for each dropped one (too few steps).

    IsoFLOP: D = C / flops_per_token(model, T).total; steps = round(D / (B * T)); the
    point then reports the C it actually uses (D rounded to whole steps).
    """
    base = base_config_dict(spec, spec_dir)
    first_model = spec.family.model(spec.depths[0])  # (its SpecError names family.*)
    try:
        probe = config_from_dict(_deep_merge(base, {"model": first_model}))
    except ConfigError as e:  # the base config or base.overrides, before any point's settings
        raise SpecError(f"base (base.config + base.overrides): {e}") from None
    seq_len = probe.train.seq_len
    hp = spec.hparams
    budgets = spec.isoflop.budgets if spec.isoflop is not None else spec.grid.tokens  # type: ignore[union-attr]
    points, dropped, ids = [], [], []
    for target in budgets:
        for depth in spec.depths:
            model_cfg = config_from_dict(_deep_merge(base, {"model": spec.family.model(depth)})).model
            n = accounting.param_count(model_cfg)
            fpt = accounting.flops_per_token(model_cfg, seq_len).total
            tokens_target = target / fpt if spec.isoflop is not None else target
            by = {ScaleBy.params: n, ScaleBy.tokens: tokens_target, ScaleBy.flops: tokens_target * fpt}
            batch = hp.batch_size.integer(by[hp.batch_size.of]) if hp.batch_size else probe.train.batch_size
            steps = int(round(tokens_target / (batch * seq_len)))
            for seed in spec.seeds:
                kind = "C" if spec.isoflop is not None else "D"
                pid = f"{kind}{_fmt(target)}-L{depth}-s{seed}"
                ids.append(pid)
                min_steps = spec.isoflop.min_steps if spec.isoflop is not None else 1
                if steps < min_steps:
                    dropped.append(f"{pid}: {steps} steps of {batch}x{seq_len} tokens < min_steps={min_steps} (N={n:,})")
                    continue
                train = {"steps": steps, "batch_size": batch}
                optimizer: dict[str, Any] = {}
                if hp.learning_rate is not None:
                    optimizer["learning_rate"] = hp.learning_rate.value(by[hp.learning_rate.of])
                if hp.warmup_fraction is not None:
                    optimizer["warmup_steps"] = max(hp.warmup_min, int(round(hp.warmup_fraction * steps)))
                cfg, error = _point_config(spec, base, depth, seed, pid, train, optimizer)
                # point_overrides may change anything; recount from the final config.
                n = accounting.param_count(cfg.model)
                fpt = accounting.flops_per_token(cfg.model, cfg.train.seq_len).total
                d = cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len
                # Kaplan's N leaves out the embedding and the output head: his models tied the two,
                # one matrix excluded as "embedding" (Kaplan et al. 2020, §2.1 and Table 1,
                # N = 2·d_model·n_layer·(2·d_attn + d_ff)). An untied head is the second such matrix.
                emb = cfg.model.vocab_size * cfg.model.hidden_size * (1 if cfg.model.tie_embeddings else 2)
                points.append(Point(pid, depth, seed, cfg, n, n - emb, d, fpt, d * fpt, float(target), error))
    _check_override_globs(spec, ids)
    _check_duplicate_runs(spec, points)
    return points, dropped


def _check_duplicate_runs(spec: SweepSpec, points: Sequence[Point]) -> None:
    """Two points with one config are one training run made twice: budgets closer than a step
    apart round to the same steps (ids keep 3 digits, so `1e4` and `1.01e4` are two ids), and
    the fit then counted the same measurement twice."""
    seen: dict[str, Point] = {}
    key = "isoflop.budgets" if spec.isoflop is not None else "grid.tokens"
    for p in points:
        if p.error is not None:
            continue
        other = seen.setdefault(p.config_hash, p)
        if other is not p:
            c = p.cfg.train
            raise SpecError(
                f"{key}{' (or point_overrides)' if spec.point_overrides else ''}: points {other.id} and {p.id} would train "
                f"the same run ({c.steps} steps of {c.batch_size}x{c.seq_len} tokens, the same model, learning rate and seed); "
                f"make the budgets differ by more than a step ({c.batch_size * c.seq_len:,} tokens) at depth {p.depth}"
            )


def _check_override_globs(spec: SweepSpec, ids: Sequence[str]) -> None:
    """A point_overrides glob that matches no point id (dropped ones included) is a typo:
    it used to change nothing, silently."""
    for pattern in spec.point_overrides:
        if not any(fnmatch.fnmatchcase(pid, pattern) for pid in ids):
            shown = ", ".join(ids[:8]) + (", ..." if len(ids) > 8 else "")
            raise SpecError(f"point_overrides.{pattern}: matches no point of this sweep; point ids: {shown}")


# ------------------------------------------------------------------------ the store

COLUMNS = {
    "id": "TEXT PRIMARY KEY",
    "sweep": "TEXT",
    "n_params": "INTEGER",  # N, exact
    "n_params_nonembedding": "INTEGER",
    "tokens": "INTEGER",  # D actually trained on
    "flops": "REAL",  # C actually used (training FLOPs, accounting.flops_per_token)
    "target": "REAL",  # the budget asked for: C (IsoFLOP) or D (grid)
    "flops_per_token": "REAL",
    "num_layers": "INTEGER",
    "hidden_size": "INTEGER",
    "steps": "INTEGER",
    "batch_size": "INTEGER",
    "seq_len": "INTEGER",
    "learning_rate": "REAL",
    "seed": "INTEGER",
    "final_loss": "REAL",  # train loss, mean over the last logging window
    "eval_loss": "REAL",  # last eval on the held-out split
    "last_step": "INTEGER",
    "wall_time": "REAL",  # seconds, summed over attempts
    "status": "TEXT",  # pending, running, done, failed, interrupted
    "error": "TEXT",  # tail of the failed attempt's stderr
    "attempts": "INTEGER",
    "job_id": "TEXT",  # pid (local) or cluster job id of the current attempt
    "run_dir": "TEXT",
    "config_hash": "TEXT",
    "updated_at": "REAL",
}


class ResultStore:
    """DIR/results.sqlite, table `points`: one row per point, one transaction per update.

    WAL mode: readers (the fitter, a notebook) never block the runner, and a crash loses
    at most the update in flight. scaling.scaling_laws.load_results reads this table.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, timeout=60)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        cols = ", ".join(f"{k} {v}" for k, v in COLUMNS.items())
        self.db.execute(f"CREATE TABLE IF NOT EXISTS points ({cols})")
        have = {r["name"] for r in self.db.execute("PRAGMA table_info(points)")}
        for k, v in COLUMNS.items():  # a store from an older runner gains the new columns
            if k not in have:
                self.db.execute(f"ALTER TABLE points ADD COLUMN {k} {v.replace('PRIMARY KEY', '')}")

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def row(self, pid: str) -> dict | None:
        r = self.db.execute("SELECT * FROM points WHERE id = ?", (pid,)).fetchone()
        return dict(r) if r is not None else None

    def rows(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM points ORDER BY rowid")]

    def add(self, sweep: str, p: Point, run_dir: str) -> None:
        """Insert a pending row for a new point (existing rows are left alone)."""
        c = p.cfg
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO points (id, sweep, n_params, n_params_nonembedding, tokens, flops, target, "
                "flops_per_token, num_layers, hidden_size, steps, batch_size, seq_len, learning_rate, seed, status, "
                "attempts, wall_time, run_dir, config_hash, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (p.id, sweep, p.n_params, p.n_params_nonembedding, p.tokens, p.flops, p.target, p.flops_per_token,
                 c.model.num_layers, c.model.hidden_size, c.train.steps, c.train.batch_size, c.train.seq_len,
                 c.optimizer.learning_rate, p.seed, "pending", 0, 0.0, run_dir, p.config_hash, time.time()),
            )  # fmt: skip
            # Rows written before the head was left out of it (session 47) get the current count.
            db.execute("UPDATE points SET n_params_nonembedding = ? WHERE id = ? AND n_params_nonembedding != ?",
                       (p.n_params_nonembedding, p.id, p.n_params_nonembedding))

    def delete(self, pid: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM points WHERE id = ?", (pid,))

    def update(self, pid: str, **values: Any) -> None:
        values["updated_at"] = time.time()
        sets = ", ".join(f"{k} = ?" for k in values)
        with self._tx() as db:
            db.execute(f"UPDATE points SET {sets} WHERE id = ?", (*values.values(), pid))

    def start(self, pid: str, job_id: str) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE points SET status = 'running', job_id = ?, error = NULL, attempts = attempts + 1, "
                "updated_at = ? WHERE id = ?",
                (job_id, time.time(), pid),
            )

    def finish(self, pid: str, out) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE points SET status = ?, final_loss = ?, eval_loss = ?, last_step = ?, error = ?, "
                "wall_time = COALESCE(wall_time, 0) + ?, updated_at = ? WHERE id = ?",
                (out.status, out.final_loss, out.eval_loss, out.last_step, out.error, out.wall_time, time.time(), pid),
            )

    def close(self) -> None:
        self.db.close()


def read_store(path: Path) -> dict[str, dict]:
    """The store's rows by id, for --dry-run, without writing anything: ResultStore would
    switch the journal mode and add a newer runner's columns (here they read as None).

    A store without a -wal or -journal file beside it holds everything in the file itself
    and is read as immutable, which creates no -wal/-shm files; otherwise (a runner is
    live, or died) it is read through those files, read-only."""
    side = [path.with_name(path.name + ext) for ext in ("-wal", "-journal")]
    mode = "mode=ro" if any(f.exists() for f in side) else "immutable=1"
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True)
    except sqlite3.Error as e:
        raise SweepError(f"{path}: cannot read the results store: {e}") from None
    db.row_factory = sqlite3.Row
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'points'").fetchone() is None:
            return {}
        rows = [dict(r) for r in db.execute("SELECT * FROM points ORDER BY rowid")]
    except sqlite3.DatabaseError as e:  # not a database, or a corrupt one
        raise SweepError(f"{path}: cannot read the results store: {e}") from None
    finally:
        db.close()
    return {r["id"]: {**dict.fromkeys(COLUMNS), **r} for r in rows}


# ------------------------------------------------------------------------ estimates


@dataclasses.dataclass(frozen=True)
class Throughput:
    tokens_per_sec: float | None  # measured / given; else FLOP-based
    flops_per_sec: float | None
    startup_s: float
    step_overhead_s: float
    source: str  # what the numbers assume, printed with the estimate

    def seconds(self, p: Point) -> float:
        compute = p.tokens / self.tokens_per_sec if self.tokens_per_sec else p.flops / self.flops_per_sec  # type: ignore[operator]
        return self.startup_s + p.steps * self.step_overhead_s + compute


def throughput(e: EstimateSpec) -> Throughput:
    if e.tokens_per_sec:
        src = f"--tokens-per-sec {e.tokens_per_sec:,.0f} (given)"
        return Throughput(e.tokens_per_sec, None, e.startup_s, e.step_overhead_s, src + _overheads(e))
    # scaling.hardware imports jax (import only: no backend, no device memory).
    from scaling.hardware import get_hardware

    hw = get_hardware(e.hardware)
    src = f"MFU {e.mfu:.0%} of {hw.name} peak {hw.bf16_flops / 1e12:,.0f} bf16 TFLOP/s (assumed)"
    return Throughput(None, e.mfu * hw.bf16_flops, e.startup_s, e.step_overhead_s, src + _overheads(e))


def _overheads(e: EstimateSpec) -> str:
    return f", + {e.startup_s:g} s start-up per point, + {e.step_overhead_s * 1e3:g} ms per step"


def schedule_seconds(times: Sequence[float], workers: int) -> float:
    """Makespan of running `times` in order on `workers` slots (each point to the first free one)."""
    slots = [0.0] * max(1, workers)
    for t in times:
        i = min(range(len(slots)), key=slots.__getitem__)
        slots[i] += t
    return max(slots)


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _trained(row: Mapping[str, Any], run_dir: Path | None) -> bool:
    """Has this point trained: finished, logged a step, or left a checkpoint in `run_dir`?"""
    return row["status"] == "done" or bool(row["last_step"]) or (run_dir is not None and (run_dir / "checkpoints").exists())


def _recorded_config(run_dir: Path | None) -> dict | None:
    """The config the point last started with (its run dir's point.yaml, as written), or None."""
    try:
        data = yaml.safe_load((run_dir / "point.yaml").read_text()) if run_dir is not None else None
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def same_config(p: Point, run_dir: Path | None) -> bool:
    """Is the config the point last started with `p.cfg`, as this code reads it? The store's
    hash is of the YAML text, which a config field added since (at its default) changes: after
    a code update every trained point read as changed, and the runner refused the whole sweep."""
    data = _recorded_config(run_dir)
    if data is None:
        return False
    try:
        return dump_yaml(config_from_dict(data)) == dump_yaml(p.cfg)
    except ConfigError:  # a key this code no longer has: it cannot tell, so it is a change
        return False


def config_diff(p: Point, run_dir: Path | None, limit: int = 4) -> str:
    """What changed in the point's config since it last started: `train.steps 44 -> 45, ...`."""
    old = _recorded_config(run_dir)
    if old is None:
        return f"no {run_dir / 'point.yaml' if run_dir else 'point.yaml'} to compare with"

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, Mapping):
            return {prefix[:-1]: d}
        return {k: v for key, sub in d.items() for k, v in flat(sub, f"{prefix}{key}.").items()}

    a, b = flat(old), flat(yaml.safe_load(dump_yaml(p.cfg)))
    diff = [f"{k} {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    return ", ".join(diff[:limit]) + (f", and {len(diff) - limit} more" if len(diff) > limit else "") if diff else "the same settings"


def trained_with_another_config(p: Point, row: Mapping[str, Any] | None, run_dir: Path | None) -> bool:
    """Did this point already train (finished, logged a step, or left a checkpoint in
    `run_dir`) with a config other than `p.cfg`? The runner refuses such points: resuming
    would mix two configs in one run dir."""
    if row is None or row["config_hash"] == p.config_hash:
        return False
    return _trained(row, run_dir) and not same_config(p, run_dir)


def dry_run_table(points: Sequence[Point], tp: Throughput, workers: int, store_rows: Mapping[str, dict] | None = None,
                  retry_failed: bool = True) -> str:
    """The --dry-run listing. `store_rows` (id -> row of an existing store) give each point's
    status; the predicted time counts only the points a run would train: not those done,
    not invalid ones, not those the runner refuses (trained with another config), and not
    failed ones under --no-retry-failed (`retry_failed=False`)."""
    rows = store_rows or {}
    head = f"{'point':<20} {'L':>3} {'d':>5} {'N':>12} {'D':>13} {'D/N':>7} {'steps':>7} {'batch':>5} {'lr':>8} {'C target':>9} {'C used':>9} {'time':>8}  status"
    lines = [head, "-" * len(head)]
    times = []
    changed = []
    for p in points:
        t = tp.seconds(p)
        row = rows.get(p.id)
        status = "invalid: " + p.error if p.error else (row or {}).get("status", "new")
        if trained_with_another_config(p, row, Path(row["run_dir"]) if row and row.get("run_dir") else None):
            changed.append(p.id)
            status += "; trained with another config: the run refuses it"
        elif status == "failed" and not retry_failed and not p.error:
            status += "; left alone (--no-retry-failed)"
        elif status != "done" and not p.error:
            times.append(t)
        target = f"{p.target:.3g}" if p.id.startswith("C") else "-"
        lines.append(
            f"{p.id:<20} {p.depth:>3} {p.cfg.model.hidden_size:>5} {p.n_params:>12,} {p.tokens:>13,} {p.tokens / p.n_params:>7.3g} "
            f"{p.steps:>7,} {p.cfg.train.batch_size:>5} {p.cfg.optimizer.learning_rate:>8.2e} {target:>9} {p.flops:>9.3g} {_hms(t):>8}  {status}"
        )
    total_c = sum(p.flops for p in points)
    lines.append(f"{len(points)} point{'s' * (len(points) != 1)}, {total_c:.3g} training FLOPs in all; throughput: {tp.source}")
    lines.append(
        f"predicted time for the {len(times)} points left: {_hms(sum(times))} in series, "
        f"{_hms(schedule_seconds(times, workers))} with --workers {workers}"
    )
    if changed:
        lines.append(
            f"{len(changed)} point(s) already trained with another config ({', '.join(changed[:4])}"
            f"{', ...' if len(changed) > 4 else ''}): the run will refuse to start; use a new --out"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------ the runner


class SweepError(RuntimeError):
    pass


@contextlib.contextmanager
def runner_lock(out: Path) -> Iterator[None]:
    """One runner per output dir; the OS drops the lock when the runner dies, however."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".runner.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"another sweep runner is using {out} (lock {out / '.runner.lock'})") from None
        yield


def _pid_alive_in(pid: int, run_dir: str) -> bool:
    """Is `pid` still a training process of this run dir (a child of a killed runner)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return run_dir in cmdline


def _wait_for_orphans(store: ResultStore, log, timeout_s: float = 180.0) -> None:
    """A killed runner's points get SIGTERM (executors._die_with_parent) and checkpoint on
    the way out; wait for them before training in the same run dirs again."""
    for r in store.rows():
        if r["status"] != "running" or not (r["job_id"] or "").isdigit():
            continue
        pid = int(r["job_id"])
        if not _pid_alive_in(pid, r["run_dir"]):
            continue
        log(f"waiting for {r['id']}'s process {pid} from an earlier runner to checkpoint and exit")
        deadline = time.monotonic() + timeout_s
        while _pid_alive_in(pid, r["run_dir"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _pid_alive_in(pid, r["run_dir"]):
            os.kill(pid, signal.SIGKILL)


def prepare_data(points: Sequence[Point], log) -> None:
    """Tokenize each distinct text corpus once, before the points start (else every point
    would train its own BPE at the same moment)."""
    from scaling.data import build_token_store

    seen = set()
    for p in points:
        d = p.cfg.data
        key = (d.source, d.path, d.tokenizer, d.cache_dir, d.eval_fraction, d.max_corpus_mb, p.cfg.model.vocab_size)
        if d.source == DataSource.text and key not in seen:
            seen.add(key)
            build_token_store(p.cfg, log=log)


def select_points(points: Sequence[Point], only: Sequence[str]) -> list[Point]:
    """The points whose id matches one of the `--only` globs (all when none are given); a
    glob that matches nothing is an error (a typo would otherwise run nothing and exit 0)."""
    if not only:
        return list(points)
    unmatched = [g for g in only if not any(fnmatch.fnmatchcase(p.id, g) for p in points)]
    if unmatched:
        ids = ", ".join(p.id for p in points[:8]) + (", ..." if len(points) > 8 else "")
        raise SweepError(f"--only {' '.join(unmatched)} matches no point of this sweep; point ids: {ids}")
    return [p for p in points if any(fnmatch.fnmatchcase(p.id, g) for g in only)]


def run_sweep(
    spec: SweepSpec,
    spec_dir: Path,
    out: Path,
    *,
    workers: int = 1,
    executor: str = "local",
    only: Sequence[str] = (),
    retry_failed: bool = True,
    cluster: str | None = None,
    log=None,
) -> list[dict]:
    """Run every unfinished point; return the store's rows. Failed points do not stop the others."""
    log = log or (lambda msg: print(msg, flush=True))
    points, dropped = generate_points(spec, spec_dir)
    if not points:  # (it ran nothing, wrote an empty store and exited 0)
        raise SweepError(
            f"every point of the sweep was dropped for too few steps ({len(dropped)}, e.g. {dropped[0]}); "
            "raise isoflop.budgets (grid.tokens), or lower the batch size or isoflop.min_steps"
        )
    spec_ids = {p.id for p in points}
    points = select_points(points, only)
    for note in dropped:
        log(f"dropped {note}")
    out = out.resolve()
    with runner_lock(out):
        ex = _make_executor(executor, workers, out / "submitit", cluster, spec.submitit)  # before any write: a bad option stops here
        with contextlib.closing(ResultStore(out / "results.sqlite")) as store:
            # Refuse before writing anything: a refused run had already replaced sweep.yaml with the
            # spec it refused, and the never-trained rows with that spec's points.
            changed = [p for p in points if trained_with_another_config(p, store.row(p.id), out / "points" / p.id)]
            if changed:
                first = changed[0]
                raise SweepError(
                    f"the spec changed the config of points that already ran: {', '.join(p.id for p in changed)}; "
                    f"use a new --out directory (or delete those points' rows and run dirs in {out}); "
                    f"{first.id}: {config_diff(first, out / 'points' / first.id)}"
                )
            (out / "sweep.yaml").write_text(yaml.safe_dump(_plain(spec), sort_keys=False))
            for p in points:
                run_dir = out / "points" / p.id
                store.add(spec.name, p, str(run_dir))
                row = store.row(p.id)
                if row["config_hash"] != p.config_hash:
                    if _trained(row, run_dir):  # the same config (same_config), hashed by an older code's YAML
                        store.update(p.id, config_hash=p.config_hash)
                    else:  # never trained: take the new config
                        store.delete(p.id)
                        store.add(spec.name, p, str(run_dir))
                if p.error is not None:
                    store.update(p.id, status="failed", error=p.error)
            # Rows of points an earlier spec made (other budgets, depths or seeds) stay in the store,
            # and `fit` reads every finished row: say so, since this spec no longer lists them.
            others = [r["id"] for r in store.rows() if r["id"] not in spec_ids and r["status"] == "done"]
            if others:
                log(f"{out / 'results.sqlite'} also holds {len(others)} finished point{'s' * (len(others) != 1)} this spec does not make "
                    f"({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}); `fit --results {out}` reads them too")
            _wait_for_orphans(store, log)
            todo = []
            for p in points:
                status = store.row(p.id)["status"]
                if p.error is not None:
                    log(f"{p.id}: failed: {p.error}")
                    continue
                if status == "done" or (status == "failed" and not retry_failed):
                    continue
                todo.append(p)
            done_before = sum(store.row(p.id)["status"] == "done" for p in points)
            if todo:
                log(f"sweep {spec.name}: {len(points)} point{'s' * (len(points) != 1)}, {done_before} already finished, running {len(todo)} in {out}")
                prepare_data(todo, log)
            _run_points(spec.name, todo, points, ex, store, out, throughput(spec.estimate))
            rows = store.rows()
    return rows


PROGRESS_EVERY_S = 2.0  # how often the bar reads the running points' metrics.jsonl
STOP_WAIT_S = 120.0  # after a Ctrl-C, how long the runner waits for its points (all together) to checkpoint


def _run_points(name: str, todo: Sequence[Point], points: Sequence[Point], ex, store: ResultStore, out: Path,
                tp: Throughput | None = None) -> None:
    """Keep up to `ex.slots` of `todo` (some of `points`, the sweep's selected points) running
    until all have ended, recording each outcome.

    The bar fills by predicted work (`tp.seconds`, the dry run's estimate; one unit a point
    without `tp`), a running point's share by the steps it has logged. It counted points: a
    long point held it still for hours, and, a sweep's budgets running smallest first, its
    ETA took the 1e14 points for as long as the 1e13 ones. Its text counts the points that
    have ended, failed ones too, then the running points' steps. The first SIGINT/SIGTERM
    stops the points (they checkpoint), a second one stops them at once (train.py exits
    without a checkpoint on its second signal)."""
    from tqdm.auto import tqdm

    from scaling.executors import error_line, last_logged_step

    queue, running, failed = list(todo), {}, []
    weight = {p.id: tp.seconds(p) if tp is not None else 1.0 for p in points}
    steps = {p.id: p.steps for p in points}
    left = {p.id for p in todo}
    ended = len(points) - len(left)

    def fraction(pid: str) -> float:  # of the point's steps, from its metrics.jsonl (a resumed point's too)
        return min(1.0, last_logged_step(out / "points" / pid) / max(1, steps[pid]))

    share = {pid: 1.0 if pid not in left else fraction(pid) for pid in weight}
    bar = tqdm(total=sum(weight.values()), initial=sum(weight[k] * v for k, v in share.items()), desc=name, dynamic_ncols=True,
               file=sys.stderr, bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]")
    seen = [time.monotonic()]

    tty = getattr(sys.stderr, "isatty", lambda: False)()

    def show(read_steps: bool = False) -> None:
        if read_steps:
            new = {pid: fraction(pid) for pid in running}
            if not tty and all(share[k] == v for k, v in new.items()):
                return  # (a log file gets a line per refresh: only when a step moved)
            share.update(new)
        bar.n = sum(weight[k] * v for k, v in share.items())
        now = [f"{pid} {round(share[pid] * steps[pid])}/{steps[pid]}" for pid in running]
        text = f"{ended}/{len(points)} points" + (f", {len(failed)} failed" if failed else "")
        bar.set_postfix_str(" | ".join([text, ", ".join(now)]) if now else text)  # (refreshes the bar)

    def record(pid: str, outcome) -> None:
        nonlocal ended
        store.finish(pid, outcome)
        loss = f" loss {outcome.final_loss:.4f}" if outcome.final_loss is not None else ""
        ev = f" eval {outcome.eval_loss:.4f}" if outcome.eval_loss is not None else ""
        bar.write(f"{pid}: {outcome.status}{loss}{ev} ({outcome.wall_time:.0f} s)")
        if outcome.status == "failed":
            failed.append(pid)
            bar.write(f"{pid}: {error_line(outcome.error)}")
        if outcome.status != "interrupted":  # (an interrupted point is still to train)
            ended += 1
            share[pid] = 1.0
        else:
            share[pid] = fraction(pid)
        show()

    stop: list[str] = []

    def on_signal(signum, _frame) -> None:
        stop.append(signal.Signals(signum).name)
        if len(stop) > 1:  # a second Ctrl-C: don't wait for the checkpoints
            bar.write(f"{stop[-1]} again: stopping the points now, without a checkpoint")
            for h in list(running.values()):
                h.cancel()

    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old[sig] = signal.signal(sig, on_signal)
        except ValueError:  # not the main thread
            pass
    try:
        while (queue or running) and not stop:
            while queue and len(running) < ex.slots and not stop:
                p = queue.pop(0)
                handle = _launch(p, ex, store, out, bar.write)
                if handle is None:
                    failed.append(p.id)
                    ended += 1
                    share[p.id] = 1.0
                else:
                    running[p.id] = handle
                show()
            for pid, handle in list(running.items()):
                outcome = handle.poll()
                if outcome is not None:
                    del running[pid]
                    record(pid, outcome)
            if time.monotonic() - seen[0] >= PROGRESS_EVERY_S:  # the running points' logged steps
                seen[0] = time.monotonic()
                show(read_steps=True)
            time.sleep(0.2)
        if stop:
            bar.write(f"{stop[0]}: stopping the running points (they checkpoint; {stop[0]} again stops them at once); re-run to resume")
            ex.shutdown()
            # train.py checkpoints, then exits. One deadline for all the points: polled one after
            # another, 120 s each, cluster jobs that never reported ended kept a Ctrl-C N x 120 s.
            deadline = time.monotonic() + STOP_WAIT_S
            while running and time.monotonic() < deadline:
                for pid, handle in list(running.items()):
                    outcome = handle.poll()
                    if outcome is not None:
                        del running[pid]
                        record(pid, outcome)
                time.sleep(0.2)
            for pid in running:
                bar.write(f"{pid}: no outcome {STOP_WAIT_S:.0f} s after the stop; its row stays `running`")
    except BaseException:  # a runner error: stop the points (they checkpoint) rather than orphan them
        ex.shutdown()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        bar.close()


def _launch(p: Point, ex, store: ResultStore, out: Path, write):
    """Start point `p` and mark it running; None when the executor cannot start it (sbatch
    refused the job, a spawn failed): the point is recorded as failed and the others go on."""
    from scaling.executors import Outcome, PointTask

    run_dir = out / "points" / p.id
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "point.yaml"
    cfg_path.write_text(dump_yaml(p.cfg))
    note = resume_note(p, store.row(p.id), run_dir)
    if note:
        write(f"{p.id}: {note}")
    try:
        handle = ex.submit(PointTask(p.id, str(cfg_path), str(run_dir), p.steps, cwd=os.getcwd()))
    except Exception as e:
        error = f"could not start: {type(e).__name__}: {e}"
        store.start(p.id, None)
        store.finish(p.id, Outcome("failed", None, None, 0, 0.0, None, error))
        write(f"{p.id}: failed: {error}")
        return None
    store.start(p.id, handle.job_id)
    return handle


def resume_note(p: Point, row: Mapping[str, Any] | None, run_dir: Path) -> str | None:
    """What a start of `p` in `run_dir` does, when it is not a first start: `train` resumes
    from the latest complete checkpoint, or trains from step 0 without one."""
    from scaling.checkpoint import complete_steps
    from scaling.executors import read_metrics

    steps = complete_steps(run_dir / "checkpoints")
    attempts = (row or {}).get("attempts") or 0
    if not attempts and not steps:
        return None
    # (the metrics, not the row: a killed runner's row never got the step its point reached)
    before = f" (attempt {attempts + 1}; the last one logged step {read_metrics(run_dir)[0]})" if attempts else ""
    if not p.cfg.checkpoint.enabled:
        return f"restarting from step 0 (checkpoint.enabled=false){before}"
    if not steps:
        return f"restarting from step 0: no checkpoint in its run dir{before}"
    if steps[-1] >= p.steps:
        return f"its checkpoint is at the last step, {steps[-1]}: collecting its result{before}"
    return f"resuming from its checkpoint at step {steps[-1]} of {p.steps}{before}"


def _make_executor(name: str, workers: int, folder: Path, cluster: str | None, options: Mapping[str, Any]):
    from scaling.executors import EXECUTORS, ExecutorError

    if name not in EXECUTORS:
        raise SweepError(f"--executor: unknown executor {name!r}; allowed: {', '.join(sorted(EXECUTORS))}")
    try:
        return EXECUTORS[name](workers=workers, folder=folder, cluster=cluster, options=options)
    except ExecutorError as e:
        raise SweepError(str(e)) from None


def _plain(x: Any) -> Any:
    from scaling.config import to_dict

    return to_dict(x)


def summary_table(rows: Sequence[dict]) -> str:
    head = f"{'point':<20} {'status':<11} {'N':>12} {'D':>13} {'C':>9} {'loss':>7} {'eval':>7} {'wall':>7}"
    lines = [head]
    for r in rows:
        f = lambda v: f"{v:.4f}" if v is not None else "-"  # noqa: E731
        lines.append(
            f"{r['id']:<20} {r['status']:<11} {r['n_params']:>12,} {r['tokens']:>13,} {r['flops']:>9.3g} "
            f"{f(r['final_loss']):>7} {f(r['eval_loss']):>7} {r['wall_time'] or 0:>6.0f}s"
        )
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "interrupted", "running", "pending")}
    lines.append(", ".join(f"{v} {k}" for k, v in counts.items() if v))
    # Why each unfinished point stopped: the per-point lines above it have scrolled away
    # by the end of a long sweep (the full stderr tail is in the store's `error`).
    from scaling.executors import error_line

    lines += [f"  {r['id']} {r['status']}: {error_line(r['error'])}" for r in rows if r["status"] != "done" and r["error"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------ CLI


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    from scaling.__main__ import _Once, join_spaced_values  # (_Once: a second --config had replaced the first)
    from scaling.executors import EXECUTORS, SUBMITIT_CLUSTERS

    p = argparse.ArgumentParser(prog="python -m scaling sweep", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", required=True, action=_Once, help="sweep spec YAML (configs/sweeps/NAME.yaml)")
    p.add_argument("--out", default=None, help="output dir (default: sweeps/<spec name>)")
    p.add_argument("--dry-run", action="store_true", help="list the points with N, D, C and predicted time; run nothing")
    p.add_argument("--workers", type=int, default=1, help="points at once (GPU machines: one GPU each, shared beyond the count)")
    p.add_argument("--executor", choices=sorted(EXECUTORS), default="local")
    p.add_argument("--cluster", choices=SUBMITIT_CLUSTERS, default=None, help="--executor submitit only: where the jobs run (default: slurm if sbatch exists)")
    p.add_argument("--only", action="append", default=[], help="run only points whose id matches this glob (repeatable)")
    p.add_argument("--no-retry-failed", dest="retry_failed", action="store_false", help="leave failed points alone on a re-run")
    p.add_argument("--tokens-per-sec", type=float, default=None, help="dry run: measured throughput per point (else the spec's MFU assumption)")
    p.add_argument("--mfu", type=float, default=None, help="dry run: assumed MFU (overrides estimate.mfu)")
    p.add_argument("--hardware", default=None, help="dry run: hardware for the MFU assumption (overrides estimate.hardware)")
    args, rest = p.parse_known_args(argv)
    rest = join_spaced_values(rest)  # (`--isoflop.budgets [1e12]` as the other commands take it)
    bad = [o for o in rest if not o.startswith("--") or "=" not in o]
    if bad:
        p.error(f"unrecognised arguments {bad}; spec overrides look like --section.key=value")
    if args.workers < 1:
        p.error(f"--workers must be >= 1 (points at once), got {args.workers}")
    if args.cluster is not None and args.executor != "submitit":  # (it was ignored, silently)
        p.error(f"--cluster {args.cluster} applies to --executor submitit only (got --executor {args.executor})")
    return args, rest


def _points_of(spec: SweepSpec, spec_dir: Path, spec_path: str) -> tuple[list[Point], list[str]]:
    """generate_points, its errors naming the spec file: a bad base.overrides key, a family or
    a point's settings that make no valid config are all errors of that file."""
    try:
        return generate_points(spec, spec_dir)
    except SpecError as e:
        raise SpecError(f"{spec_path}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    spec, spec_dir = load_spec(args.config, overrides)
    est = {k: v for k, v in {"tokens_per_sec": args.tokens_per_sec, "mfu": args.mfu, "hardware": args.hardware}.items() if v is not None}
    if est:
        spec = dataclasses.replace(spec, estimate=dataclasses.replace(spec.estimate, **est))
        validate_spec(spec)
    out = Path(args.out or Path("sweeps") / spec.name)
    points, dropped = _points_of(spec, spec_dir, args.config)
    if args.dry_run:
        try:
            points = select_points(points, args.only)
            rows = read_store(out / "results.sqlite") if (out / "results.sqlite").exists() else {}
        except SweepError as e:
            print(f"sweep error: {e}", file=sys.stderr)
            return 2
        print(dry_run_table(points, throughput(spec.estimate), args.workers, rows, args.retry_failed))
        for note in dropped:
            print(f"dropped {note}")
        return 0
    try:
        rows = run_sweep(
            spec, spec_dir, out, workers=args.workers, executor=args.executor, only=args.only,
            retry_failed=args.retry_failed, cluster=args.cluster,
        )  # fmt: skip
    except SweepError as e:
        print(f"sweep error: {e}", file=sys.stderr)
        return 2
    print(summary_table(rows))
    print(f"results: {out / 'results.sqlite'}")
    # The exit status judges what this run was asked to train: the spec's points that --only
    # selects (rows outside --only, or of points the spec no longer has, made it 1 regardless).
    asked = {p.id for p in select_points(points, args.only)}
    return 0 if all(r["status"] == "done" for r in rows if r["id"] in asked) else 1
