"""Typed, frozen, nested configs.

A run's config is the defaults below, updated by a YAML file that holds only the deltas,
updated by dotted command-line overrides (`--model.num_layers=4`). draccus decodes the
merged dict into the dataclasses (typed, unknown keys rejected); `validate` then checks
what types cannot express (divisibility, lengths, signs) before anything compiles. A Config
built in Python (`Config(...)`, `dataclasses.replace`) gets the same checks when constructed,
and its values are normalised as decoding would (enum members, tuples, int/float, str paths).

A YAML file may name another one to start from with `inherit: relative/path.yaml`
(experiment configs inherit a model preset from `configs/models/`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import draccus
import yaml


class ConfigError(ValueError):
    """A config value is unknown, mistyped or impossible. The message names the key."""


class StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return self.value


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"  # compute dtype only: bfloat16 on GPU/TPU, float32 on CPU


class AttentionImpl(StrEnum):
    xla = "xla"  # reference einsum + softmax, runs anywhere
    cudnn = "cudnn"  # jax.nn.dot_product_attention(implementation="cudnn"), GPU only
    pallas = "pallas"  # our Pallas flash-attention kernel (scaling.kernels)
    auto = "auto"  # per call (attention.resolve_impl): ours on Hopper up to 8k tokens, cuDNN on other GPUs and beyond, xla elsewhere and where cuDNN cannot take the call


class RematPolicyName(StrEnum):
    none = "none"
    full = "full"
    dots = "dots"
    names = "names"
    offload = "offload"
    selective = "selective"


class Schedule(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class DataSource(StrEnum):
    text = "text"  # real text, tokenized and packed (the default corpus when path is unset)
    tokens = "tokens"  # a pre-tokenized flat token file (.npy, or raw uint16/uint32 .bin)
    synthetic = "synthetic"  # deterministic random tokens, for benchmarks


class TokenizerKind(StrEnum):
    bpe = "bpe"  # byte-level BPE trained on the corpus (HF `tokenizers`)
    byte = "byte"  # raw UTF-8 bytes, vocabulary 256 (+ EOS)


class NonFinitePolicy(StrEnum):
    stop = "stop"
    skip = "skip"


class AxisType(StrEnum):
    auto = "auto"  # the compiler propagates shardings; our constraints pin key activations
    explicit = "explicit"  # shardings are part of the types (JAX's default since 0.9)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder shape. Dimension names follow the book: D, F, N, K, H, L, V."""

    vocab_size: int = 512  # V
    hidden_size: int = 128  # D
    num_layers: int = 2  # L
    num_heads: int = 4  # N, query heads
    num_kv_heads: int = 2  # K, GQA key/value heads (K == N is MHA)
    head_dim: int | None = None  # H; defaults to D / N
    mlp_dim: int = 384  # F, SwiGLU hidden width
    max_seq_len: int = 2048  # the longest row trained on (RoPE is computed per position); train.seq_len must not exceed it
    rope_theta: float = 10000.0
    # Llama 3.x frequency scaling ("llama3" rope_type); factor 0 means off.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    param_dtype: DType = DType.float32
    compute_dtype: DType = DType.auto
    scan_layers: bool = True  # one compiled layer body under lax.scan; False unrolls

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh over named axes; one size may be -1 to take the remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rules: str = "default"  # named logical-axis rule set (scaling.sharding.rules)
    axis_type: AxisType = AxisType.auto
    # Multi-host: jax.distributed. Unset fields fall back to the usual environment
    # variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # global batch, in sequences, per optimizer step
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per step; batch_size must divide evenly
    log_every: int = 10
    eval_every: int = 50  # 0 disables eval
    eval_batches: int = 4
    seed: int = 0
    nonfinite: NonFinitePolicy = NonFinitePolicy.stop
    show_shardings: bool = False  # print the sharding report before training
    # Chunked cross-entropy: the output head and loss run over chunks of this many sequence
    # positions (all batch rows at once), so the f32 [B, T, V] logits are never stored
    # (scaling.train.chunked_cross_entropy). Must divide seq_len; 0 = off (one [B, T, V] pass).
    loss_chunk: int = 0


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    schedule: Schedule = Schedule.cosine
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied to matrices only (not norms); see decay_embeddings
    decay_embeddings: bool = False
    clip_norm: float = 1.0  # global-norm clipping; 0 disables


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: DataSource = DataSource.text
    path: str | None = None  # None: the embedded default corpus (Python stdlib sources)
    tokenizer: TokenizerKind = TokenizerKind.bpe
    cache_dir: str = ".cache/data"  # tokenized corpora are stored here once, memory-mapped
    eval_fraction: float = 0.05  # held-out share of the packed sequences
    max_corpus_mb: float = 8.0  # cap on the default corpus size


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    impl: AttentionImpl = AttentionImpl.auto
    # Temporary memory (MiB) our Mosaic GPU backward may use for multi-head D=128 attention to
    # keep dS between its kernels (5 matmuls per tile instead of 7; docs/attention.md, twelfth
    # session). Larger calls run in chunks; 0 keeps the O(T) split kernels.
    bwd_workspace_mb: int = 4096


@dataclasses.dataclass(frozen=True)
class RematConfig:
    policy: RematPolicyName = RematPolicyName.none
    names: tuple[str, ...] = ()  # checkpoint_name tags to save, for `names` and `offload`


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    every: int = 100  # steps between saves (and always at the end); 0: only at the end
    keep: int = 3  # most recent checkpoints kept
    keep_period: int = 0  # also keep every M-th step forever; 0: off
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    # [start, stop): capture a JAX profiler trace of these steps into <run_dir>/profile.
    # `python -m scaling train --profile` sets (5, 8). Empty: no trace.
    steps: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    progress: bool = True  # tqdm progress bar on the console


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    attention: AttentionConfig = dataclasses.field(default_factory=AttentionConfig)
    remat: RematConfig = dataclasses.field(default_factory=RematConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    profile: ProfileConfig = dataclasses.field(default_factory=ProfileConfig)
    run_dir: str | None = None  # None: runs/<config name>-<timestamp>

    def __post_init__(self) -> None:
        # A Config built in Python (Config(...), dataclasses.replace) skips load_config; train()
        # took it unchecked (a "5" for an int, a plain "byte" that data.py's `.value` failed on,
        # seq_len over max_seq_len). Check and normalise it here, for every path alike.
        _normalise_sections(self)
        validate(self)


# --------------------------------------------------------------------------- loading

_SECTIONS = frozenset(k for k, tp in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(tp))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key repeated in one mapping is an error (PyYAML keeps
    the last one silently, so a stale line above an edited one would win unnoticed)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` merges; keys written next to it override it
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"key {key!r} repeated (first at line {first.start_mark.line + 1}); keep only one",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)



def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"inherit cycle: {' -> '.join(map(str, seen + (path,)))}")
    if not path.is_file():
        by = f" (inherited by {seen[-1]})" if seen else ""
        if path.is_dir():  # (it said "not found" of a folder that is there)
            raise ConfigError(f"config file {path}{by} is a directory; name a YAML file in it")
        raise ConfigError(f"config file not found: {path}{by}")
    try:
        with open(path, "rb") as f:
            data = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as e:  # syntax errors, tabs, repeated keys, not UTF-8 ...
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    # A section left empty (`model:` with its keys commented out) reads as null: it changes
    # nothing (dropped here, before an inherited file's section could be replaced by it).
    data = {k: v for k, v in data.items() if not (v is None and k in _SECTIONS)}
    if "inherit" not in data:
        return data
    parent = data.pop("inherit")  # (`inherit:` left empty is refused below, not read as "no parent")
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError(f"{path}: inherit must be the path of a YAML file (relative to this one), got {parent!r}")
    base = _read_yaml(path.parent / parent, seen + (path,))
    return _deep_merge(base, data)


def _deep_merge(base: Mapping[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in delta.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _field_type(cls: type, dotted: Sequence[str]) -> Any:
    """The declared type of the field at `dotted` under dataclass `cls`, or None if unknown."""
    node: Any = cls
    for part in dotted:
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return None
        node = typing.get_type_hints(node).get(part)
        if node is None:
            return None
    return node


def _optional_of(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


_NULLS = ("null", "Null", "NULL", "~")


def parse_overrides(overrides: Iterable[str], schema: type | None = None) -> dict[str, Any]:
    """`--model.num_layers=4` / `model.num_layers=4` -> {"model": {"num_layers": 4}}.

    Values are parsed as YAML scalars (so `4` is an int, `[1, 2]` a list, `null` None),
    except that a field `schema` (a config dataclass) declares as a string takes the text
    as written (`--run_dir=017` is '017', not YAML 1.1's octal 15; `null` still unsets an
    optional one). A mapping value (`--model={num_layers: 4}`) updates that section field
    by field. A key given twice: the last one wins, as with argparse. A boolean field given
    alone (`--train.show_shardings`) is set true, as an argparse flag would be.
    """
    # (a str is iterable too: each character became an "override", and the error showed '-')
    if not isinstance(overrides, (str, bytes)):
        overrides = list(overrides)  # (read once: it may be a generator)
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"overrides must be a list of strings such as ['--train.steps=5'], got {overrides!r}")
    tree: dict[str, Any] = {}
    for raw in overrides:
        item = raw[2:] if raw.startswith("--") else raw
        if "=" not in item:
            if _optional_of(_field_type(schema, item.split(".")) if schema is not None else None)[0] is not bool:
                raise ConfigError(f"override {raw!r} has no value; overrides look like --section.key=value")
            item += "=true"  # a bare boolean flag, as argparse users write it
        dotted, text = item.split("=", 1)
        parts = dotted.split(".")
        if not all(parts):
            raise ConfigError(f"override {raw!r}: empty key in {dotted!r}; overrides look like --section.key=value")
        tp = _field_type(schema, parts) if schema is not None else None
        base, optional = _optional_of(tp)
        if base is str and text not in _NULLS:
            value: Any = text
        else:
            try:
                value = yaml.safe_load(text) if text != "" else ""
            except yaml.YAMLError:
                value = text
        node = tree
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):  # (absent, or a value an earlier key set: the last wins)
                node[part] = {}
            node = node[part]
        last = parts[-1]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            node[last] = _deep_merge(node[last], value)
        else:
            node[last] = value
    return tree


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


_PLURAL = {int: "integers", float: "numbers", str: "strings"}
_EXAMPLE = {int: "[5, 8]", float: "[0.5, 1.0]", str: "[a, b]"}


def _describe(tp: Any) -> str:
    """The type in words, for error messages."""
    base, optional = _optional_of(tp)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        words = f"one of {', '.join(m.value for m in base)}"
    elif typing.get_origin(base) is tuple:
        elem = typing.get_args(base)[0]
        words = f"a list of {_PLURAL.get(elem, str(elem))}, e.g. {_EXAMPLE.get(elem, '[a, b]')}"
    else:
        words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(base, str(base))
    return f"{words} or null" if optional else words


def _type_error(tp: Any, value: Any, read: bool = True) -> str | None:
    """Why `value` cannot be a `tp`, or None if it can. `read`: the value came from YAML or an
    override (not from Python), so a YAML reading may explain it."""
    base, optional = _optional_of(tp)
    if value is None:
        return None if optional else "cannot be null"
    if isinstance(base, type) and issubclass(base, enum.Enum):
        if isinstance(value, base) or (isinstance(value, str) and value in {m.value for m in base}):
            return None
        near = [m.value for m in base if isinstance(value, str) and m.value.lower() == value.lower()]
        return f"{value!r} is not allowed" + (f" (values are lower case: did you mean {near[0]!r}?)" if near else "")
    if base is bool:
        return None if isinstance(value, bool) else f"got {value!r}"
    if base is int or base is float:
        # A string that parses is fine: YAML 1.1 reads `3e-4` (no dot) as a string.
        if isinstance(value, str):
            try:
                base(value)
            except ValueError:
                return f"got {value!r}"
            return None
        ok = numbers.Integral if base is int else numbers.Real  # (numpy scalars too)
        return None if isinstance(value, ok) and not isinstance(value, bool) else f"got {value!r}"
    if base is str:
        if isinstance(value, (str, os.PathLike)):
            return None
        hint = " (YAML read it as a number or a boolean; quote it)" if read and isinstance(value, (int, float, bool)) else ""
        return f"got {type(value).__name__} {value!r}{hint}"
    if typing.get_origin(base) is tuple:
        if not isinstance(value, (list, tuple)):
            return f"got {type(value).__name__} {value!r}"
        return None  # elements: checked by the caller
    return None


def _check_keys(cls: type, data: Mapping[str, Any], prefix: str = "") -> None:
    """Reject unknown keys (with the list of allowed ones: draccus's message lacks it) and
    values of the wrong kind (null for a required field, true for a number, a number for a
    string, a string for a list ...), naming the key and what it takes."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(
                f"unknown config key {where!r}; allowed keys under "
                f"{prefix.rstrip('.') or 'the top level'}: {', '.join(_field_names(cls))}"
            )
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where} must be a mapping of its fields, got {value!r}")
            _check_keys(tp, value, f"{where}.")
            continue
        if isinstance(value, Mapping):
            raise ConfigError(f"{where} is a single value, not a section: got {dict(value)!r}; it takes {_describe(tp)}")
        _check_value(where, tp, value)


def _check_value(where: str, tp: Any, value: Any, read: bool = True) -> None:
    """Raise a ConfigError naming `where` if `value` cannot be a `tp` (list elements too)."""
    why = _type_error(tp, value, read)
    if why is None and typing.get_origin(_optional_of(tp)[0]) is tuple and value is not None:
        elem = typing.get_args(_optional_of(tp)[0])[0]
        for i, v in enumerate(value):
            bad = _type_error(elem, v, read) if not isinstance(v, Mapping) else f"got {v!r}"
            if bad is not None:
                raise ConfigError(f"{where}[{i}]: {bad}; it takes {_describe(elem)}")
    if why is not None:
        base, optional = _optional_of(tp)
        if isinstance(base, type) and issubclass(base, enum.Enum):  # (the wording tests and users grep for)
            allowed = ", ".join(m.value for m in base) + (", null" if optional else "")
            raise ConfigError(f"{where}: {why}; allowed values: {allowed}")
        raise ConfigError(f"{where}: {why}; it takes {_describe(tp)}")


def _normalised(tp: Any, value: Any) -> Any:
    """A value `_check_value` accepted, as decoding would hold it: an enum member for its value
    string, a tuple for a list, int/float for numpy scalars (or a number string), str for a path."""
    base, _ = _optional_of(tp)
    if value is None or base is bool:
        return value
    if (isinstance(base, type) and issubclass(base, enum.Enum)) or base in (int, float):
        return base(value)
    if base is str:
        return os.fspath(value)
    if typing.get_origin(base) is tuple:
        return tuple(_normalised(typing.get_args(base)[0], v) for v in value)
    return value


def _normalise_sections(cfg: "Config") -> None:
    """Check the types of a Config's fields and normalise them in place (at construction)."""
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(cfg):
        value, tp = getattr(cfg, f.name), hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"{f.name}: got {type(value).__name__} {value!r}; it takes a {tp.__name__} "
                                  "(load_config and replace take mappings)")
            inner = typing.get_type_hints(tp)
            changes = {}
            for g in dataclasses.fields(value):
                v = getattr(value, g.name)
                _check_value(f"{f.name}.{g.name}", inner[g.name], v, read=False)  # (built in Python)
                n = _normalised(inner[g.name], v)
                if type(n) is not type(v) or n != v:
                    changes[g.name] = n
            if changes:
                object.__setattr__(cfg, f.name, dataclasses.replace(value, **changes))
        else:
            _check_value(f.name, tp, value, read=False)
            object.__setattr__(cfg, f.name, _normalised(tp, value))


def _enum_hint(cls: type, dotted: str) -> str:
    """For an enum-typed field, the allowed values (to append to a decoding error)."""
    node: Any = cls
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node):
            return ""
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return ""
        f = fields[part]
        node = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(node):
            node = type(node)
    if isinstance(node, enum.Enum):
        return f"; allowed values: {', '.join(m.value for m in type(node))}"
    return ""


def config_from_dict(data: Mapping[str, Any]) -> Config:
    _check_keys(Config, data)
    try:
        return draccus.decode(Config, dict(data))  # Config.__post_init__ validates
    except Exception as e:  # draccus.utils.DecodingError, names the key as `a.b`
        if isinstance(e.__cause__, ConfigError):  # ours, wrapped by draccus ("Couldn't instantiate ...")
            raise e.__cause__ from None
        msg = str(e)
        key = msg.split("`")[1] if msg.count("`") >= 2 else ""
        raise ConfigError(f"invalid config value: {msg}{_enum_hint(Config, key)}") from None


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults <- YAML deltas at `path` (if any) <- dotted overrides. Validated."""
    data = _read_yaml(Path(path)) if path is not None else {}
    data = _deep_merge(data, parse_overrides(overrides, Config))
    return config_from_dict(data)


def to_dict(cfg: Any) -> Any:
    """Plain nested dict (enums as strings, tuples as lists): for YAML/JSON and checkpoints."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    return cfg


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Config, **sections: Mapping[str, Any]) -> Config:
    """Copy with some fields changed, e.g. replace(cfg, train={"steps": 5}) or
    replace(cfg, model=dataclasses.replace(cfg.model, num_layers=4)); re-validated."""
    data = to_dict(cfg)
    data = _deep_merge(data, {k: to_dict(v) if dataclasses.is_dataclass(v) else v for k, v in sections.items()})
    return config_from_dict(data)


# ------------------------------------------------------------------------ validation


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def _float_fields(node: Any, prefix: str = "") -> Iterable[tuple[str, float]]:
    """(dotted key, value) of every float field under a config dataclass."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_fields(value, f"{prefix}{f.name}.")
        elif _optional_of(hints[f.name])[0] is float and value is not None:
            yield f"{prefix}{f.name}", value


_MODEL_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "mlp_dim", "max_seq_len")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def validate_model(m: ModelConfig) -> None:
    """The model section's checks. scaling.model.Transformer runs them too: a ModelConfig built in
    Python skips load_config, and its mistakes failed at the first call, deep inside jnp
    (ZeroDivisionError for num_heads=0 or num_layers=0, an attention-shape error for num_kv_heads=3)."""
    for name in (*_MODEL_SIZES, "rope_original_max_len"):
        _require(_is_int(getattr(m, name)), f"model.{name}", f"must be an integer, got {getattr(m, name)!r}")
    _require(m.head_dim is None or _is_int(m.head_dim), "model.head_dim", f"must be an integer or None, got {m.head_dim!r}")
    for name in ("param_dtype", "compute_dtype"):
        _require(getattr(m, name) in {x.value for x in DType}, f"model.{name}",
                 f"{getattr(m, name)!r} is not allowed; allowed values: {', '.join(x.value for x in DType)}")
    for name in _MODEL_SIZES:
        _require(getattr(m, name) > 0, f"model.{name}", f"must be a positive integer, got {getattr(m, name)}")
    _require(
        m.num_heads % m.num_kv_heads == 0,
        "model.num_heads",
        f"{m.num_heads} heads is not divisible by model.num_kv_heads={m.num_kv_heads}; "
        "GQA needs num_heads to be a multiple of num_kv_heads",
    )
    if m.head_dim is not None:
        _require(m.head_dim > 0, "model.head_dim", f"must be positive, got {m.head_dim}")
    derived = "" if m.head_dim is not None else f" (model.hidden_size={m.hidden_size} // model.num_heads={m.num_heads}; set model.head_dim)"
    _require(m.resolved_head_dim >= 2 and m.resolved_head_dim % 2 == 0, "model.head_dim",
             f"RoPE rotates pairs of dimensions and needs an even head_dim >= 2, got {m.resolved_head_dim}{derived}")
    if m.head_dim is None:
        _require(
            m.hidden_size % m.num_heads == 0,
            "model.hidden_size",
            f"{m.hidden_size} is not divisible by model.num_heads={m.num_heads}; set model.head_dim explicitly",
        )
    for name in ("rope_theta", "norm_eps", "init_std"):
        _require(_positive(getattr(m, name)), f"model.{name}", f"must be a positive finite number, got {getattr(m, name)}")
    _require(
        m.rope_scaling_factor == 0 or (math.isfinite(m.rope_scaling_factor) and m.rope_scaling_factor >= 1),
        "model.rope_scaling_factor",
        f"must be 0 (off) or a finite factor >= 1, got {m.rope_scaling_factor} (Llama 3's long-context scaling divides frequencies by it)",
    )
    if m.rope_scaling_factor:
        # (layers.rope_frequencies divides by the low factor and by high - low)
        _require(
            _positive(m.rope_low_freq_factor) and _positive(m.rope_high_freq_factor) and m.rope_low_freq_factor < m.rope_high_freq_factor,
            "model.rope_low_freq_factor/rope_high_freq_factor",
            f"need 0 < low < high with rope scaling on, got {m.rope_low_freq_factor}, {m.rope_high_freq_factor}",
        )
        _require(m.rope_original_max_len > 0, "model.rope_original_max_len", f"must be positive with rope scaling on, got {m.rope_original_max_len}")
    _require(m.param_dtype != DType.auto, "model.param_dtype", "must be float32, bfloat16 or float16 (not auto)")


def validate_attention(a: AttentionConfig) -> None:
    """The attention section's checks (also run by scaling.model.Transformer, as validate_model)."""
    _require(a.impl in {x.value for x in AttentionImpl}, "attention.impl",
             f"{a.impl!r} is not allowed; allowed values: {', '.join(x.value for x in AttentionImpl)}")
    _require(_is_int(a.bwd_workspace_mb) and a.bwd_workspace_mb >= 0, "attention.bwd_workspace_mb",
             f"must be an int >= 0 (MiB; 0 keeps the backward's split kernels), got {a.bwd_workspace_mb!r}")


def validate_optimizer(o: OptimizerConfig) -> None:
    """The optimizer section's checks (also run by scaling.optim for a bare OptimizerConfig, which
    only a whole Config checks when built: a misspelt schedule had run as `constant`)."""
    _require(o.schedule in {x.value for x in Schedule}, "optimizer.schedule",
             f"{o.schedule!r} is not allowed; allowed values: {', '.join(x.value for x in Schedule)}")
    _require(_is_int(o.warmup_steps), "optimizer.warmup_steps", f"got {o.warmup_steps!r}; it takes an integer")
    _require(_positive(o.learning_rate), "optimizer.learning_rate", f"must be a positive finite number, got {o.learning_rate}")
    _require(_positive(o.eps), "optimizer.eps", f"must be a positive finite number (Adam divides by sqrt(v) + eps; v is 0 for unused rows), got {o.eps}")
    _require(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, "optimizer.b1/b2", f"must be in [0, 1), got {o.b1}, {o.b2}")
    _require(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(o.clip_norm >= 0, "optimizer.clip_norm", f"must be >= 0 (0 disables), got {o.clip_norm}")


def validate(cfg: Config) -> None:
    m, t, o, d, mesh = cfg.model, cfg.train, cfg.optimizer, cfg.data, cfg.mesh
    validate_model(m)
    validate_attention(cfg.attention)

    for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches"):
        _require(getattr(t, name) > 0, f"train.{name}", f"must be a positive integer, got {getattr(t, name)}")
    _require(t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0 disables eval), got {t.eval_every}")
    _require(0 <= t.seed < 2**63, "train.seed", f"must be in [0, 2**63) (numpy and jax.random seeds), got {t.seed}")
    _require(
        t.seq_len <= m.max_seq_len,
        "train.seq_len",
        f"{t.seq_len} exceeds model.max_seq_len={m.max_seq_len} (the longest row the model is configured for)",
    )
    _require(
        t.batch_size % t.grad_accum == 0,
        "train.batch_size",
        f"{t.batch_size} is not divisible by train.grad_accum={t.grad_accum}",
    )
    _require(t.loss_chunk >= 0, "train.loss_chunk", f"must be >= 0 (0 turns chunking off), got {t.loss_chunk}")
    _require(
        t.loss_chunk == 0 or t.seq_len % t.loss_chunk == 0,
        "train.loss_chunk",
        f"{t.loss_chunk} does not divide train.seq_len={t.seq_len}; use a divisor of seq_len, or 0 to turn chunking off",
    )
    _require(
        len(cfg.profile.steps) in (0, 2) and (not cfg.profile.steps or 0 <= cfg.profile.steps[0] < cfg.profile.steps[1]),
        "profile.steps",
        f"must be empty or [start, stop) with 0 <= start < stop, got {list(cfg.profile.steps)}",
    )

    validate_optimizer(o)

    _require(0 < d.eval_fraction < 1, "data.eval_fraction", f"must be in (0, 1), got {d.eval_fraction}")
    _require(d.max_corpus_mb > 0, "data.max_corpus_mb", f"must be positive, got {d.max_corpus_mb}")
    if d.source == DataSource.tokens:
        _require(d.path is not None, "data.path", "data.source=tokens needs a token file path")
    if d.tokenizer == TokenizerKind.byte and d.source == DataSource.text:
        _require(m.vocab_size >= 257, "model.vocab_size", f"the byte tokenizer needs >= 257 (256 bytes + EOS), got {m.vocab_size}")
    if d.tokenizer == TokenizerKind.bpe and d.source == DataSource.text:
        _require(m.vocab_size >= 260, "model.vocab_size", f"a byte-level BPE needs >= 260 tokens, got {m.vocab_size}")

    for key, value in (("run_dir", cfg.run_dir), ("data.path", d.path), ("data.cache_dir", d.cache_dir), ("mesh.coordinator_address", mesh.coordinator_address)):
        _require(value is None or str(value).strip() != "", key, "must not be empty" + (" (null: unset)" if key != "data.cache_dir" else ""))

    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    for name, size in sizes.items():
        _require(size == -1 or size >= 1, f"mesh.{name}", f"must be >= 1 or -1 (take the remaining devices), got {size}")
    _require(
        sum(1 for s in sizes.values() if s == -1) <= 1,
        "mesh",
        f"at most one axis may be -1, got {sizes}",
    )
    from scaling.sharding.rules import RULE_SETS  # (imports only the axis names: no jax)

    _require(mesh.rules in RULE_SETS, "mesh.rules", f"{mesh.rules!r} is not a rule set; allowed: {', '.join(sorted(RULE_SETS))}")

    _require(cfg.checkpoint.every >= 0, "checkpoint.every", f"must be >= 0, got {cfg.checkpoint.every}")
    _require(cfg.checkpoint.keep >= 1, "checkpoint.keep", f"must be >= 1, got {cfg.checkpoint.keep}")
    _require(cfg.checkpoint.keep_period >= 0, "checkpoint.keep_period", f"must be >= 0, got {cfg.checkpoint.keep_period}")
    if cfg.remat.policy in (RematPolicyName.names, RematPolicyName.offload):
        _require(
            len(cfg.remat.names) > 0,
            "remat.names",
            f"remat.policy={cfg.remat.policy.value} needs the checkpoint_name tags to save",
        )
    # Last (the checks above say more where they apply): a NaN or inf that a range check lets
    # through (weight_decay=.inf trained to NaN params; clip_norm, max_corpus_mb) or that no
    # check looks at (the RoPE factors with scaling off).
    for key, value in _float_fields(cfg):
        _require(math.isfinite(value), key, f"must be a finite number, got {value}")
