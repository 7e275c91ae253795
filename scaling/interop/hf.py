"""Hugging Face Llama checkpoints in and out: config.json + safetensors <-> ModelConfig + Transformer.

Weight map (HF `nn.Linear` weights are [out, in]; ours are [in, out] with heads split):

    model.embed_tokens.weight              [V, D]     embed.table_vd
    model.layers.i.input_layernorm.weight  [D]        blocks.attn_norm.scale[i]
    model.layers.i.self_attn.q_proj.weight [N H, D]   blocks.attn.q_dnh[i]   = W.T -> [D, N, H]
    model.layers.i.self_attn.k_proj.weight [K H, D]   blocks.attn.k_dkh[i]   = W.T -> [D, K, H]
    model.layers.i.self_attn.v_proj.weight [K H, D]   blocks.attn.v_dkh[i]   = W.T -> [D, K, H]
    model.layers.i.self_attn.o_proj.weight [D, N H]   blocks.attn.o_nhd[i]   = W.T -> [N, H, D]
    model.layers.i.post_attention_layernorm.weight    blocks.mlp_norm.scale[i]
    model.layers.i.mlp.gate_proj.weight    [F, D]     blocks.mlp.gate_df[i]  = W.T
    model.layers.i.mlp.up_proj.weight      [F, D]     blocks.mlp.up_df[i]    = W.T
    model.layers.i.mlp.down_proj.weight    [D, F]     blocks.mlp.down_fd[i]  = W.T
    model.norm.weight                      [D]        final_norm.scale
    lm_head.weight                         [V, D]     head_dv = W.T (absent when tied)

RoPE: HF's LlamaRotaryEmbedding rotates with `rotate_half`, pairing dims (i, i + H/2): the
half-split layout of layers.apply_rope, so q/k rows need no permutation (Meta's original
checkpoints pair (2i, 2i+1); HF's conversion script permutes them into this layout). The
golden-logit tests in tests/test_hf_interop.py check it.

Safetensors files are read and written with the `safetensors` library's numpy API (bf16 as
ml_dtypes.bfloat16), so no torch is needed.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from scaling.config import AttentionConfig, Config, DType, ModelConfig
from scaling.model import Transformer

# The dtypes weights are held and saved in (ModelConfig's param_dtype, less "auto").
PARAM_DTYPES = ("float32", "bfloat16", "float16")


class HFFormatError(ValueError):
    """The directory is not a Llama-family checkpoint we can read (the message says why)."""


# ------------------------------------------------------------------------- safetensors


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """name -> numpy array (bf16 as ml_dtypes.bfloat16), via the `safetensors` library."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, TypeError, ValueError) as e:
        raise HFFormatError(f"{path}: cannot read safetensors: {e}") from None
    except AttributeError as e:  # (numpy has no such dtype: an FP8 checkpoint's F8_E4M3 had been a traceback)
        raise HFFormatError(f"{path}: holds tensors of a dtype numpy cannot read ({e}); allowed: F16, BF16, F32 "
                            "(a quantized checkpoint?)") from None


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Atomic write (temporary file, then rename) via the `safetensors` library."""
    from safetensors.numpy import save_file

    tmp = Path(str(path) + ".tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=metadata or {"format": "pt"})
    # The library creates its file 0600; give it the mode every other file of the directory gets
    # (0666 less the umask), so the weights are as readable as config.json beside them.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    tmp.replace(path)


def _read_json(path: Path) -> dict:
    """A JSON object from path (HFFormatError naming the file where it is not one)."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:  # (a directory of that name, no permission)
        raise HFFormatError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not isinstance(value, dict):
        raise HFFormatError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _read_all_tensors(path: Path) -> dict[str, np.ndarray]:
    # model.safetensors before the index, as transformers' from_pretrained looks: with both there,
    # it loads the single file (an index beside it had made us load other weights than it does)
    single = path / "model.safetensors"
    if single.exists():
        return read_safetensors(single)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFFormatError(f"{index} has no weight_map (tensor name -> shard file)")
        tensors: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise HFFormatError(f"{index} names shard {shard}, which is not in {path}")
            tensors.update(read_safetensors(path / shard))
        missing = set(weight_map) - set(tensors)
        if missing:
            raise HFFormatError(f"{index} names tensors its shards lack: {sorted(missing)[:5]}")
        return tensors
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFFormatError(f"{path} has no model.safetensors, index or *.safetensors file (pytorch_model.bin is not read)")
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


# ---------------------------------------------------------------------------- config


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _require(ok: bool, key: str, value, allowed: str) -> None:
    """HFFormatError naming the config.json key, its value and what it may be."""
    if not ok:
        raise HFFormatError(f"config.json: {key}={value!r}; allowed: {allowed}")


def config_from_hf(hf: dict, *, param_dtype: DType | None = None) -> ModelConfig:
    """A Llama-family config.json -> ModelConfig (rejects what our model does not compute)."""
    arch = hf.get("architectures") or []
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "mistral") and not any("Llama" in a for a in arch):
        raise HFFormatError(f"model_type={model_type!r} is not a Llama-family model; allowed: 'llama', 'mistral'")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise HFFormatError(f"{flag}={json.dumps(hf[flag])} is not supported (our Llama has no biases); "
                                "allowed: false")
    # (the weights are codes and scales the model would read as weights: an int8 or fp8 checkpoint)
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise HFFormatError(f"quantization_config (quant_method={method!r}): quantized checkpoints are not supported; "
                            "allowed: none (float16, bfloat16 or float32 weights)")
    if hf.get("hidden_act", "silu") != "silu":
        raise HFFormatError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if not isinstance(hf.get(k), int) or isinstance(hf.get(k), bool) or hf[k] < 1]
    if missing:
        raise HFFormatError("config.json needs " + ", ".join(f"{k} (a positive int; got {hf.get(k)!r})"
                                                             for k in missing))
    n = hf["num_attention_heads"]
    d = hf["hidden_size"]
    kv = hf.get("num_key_value_heads") or n
    _require(_is_int(kv) and kv > 0, "num_key_value_heads", kv, "a positive int, or null (= num_attention_heads)")
    if n % kv:
        raise HFFormatError(f"num_attention_heads={n} is not a multiple of num_key_value_heads={kv!r}")
    head_dim = hf.get("head_dim")
    # (RoPE rotates pairs of a head's dims)
    _require(head_dim is None or (_is_int(head_dim) and head_dim > 0 and head_dim % 2 == 0), "head_dim", head_dim,
             "a positive even int, or null (= hidden_size / num_attention_heads)")
    if head_dim is None and d % n:
        raise HFFormatError(f"hidden_size={d} is not a multiple of num_attention_heads={n}, and no head_dim is given")
    if head_dim is not None and head_dim == d // n and d % n == 0:
        head_dim = None  # the default; keep the config minimal
    # transformers 5 nests RoPE settings in rope_parameters; 4.x uses rope_theta + rope_scaling.
    for key in ("rope_parameters", "rope_scaling"):
        _require(isinstance(hf.get(key) or {}, dict), key, hf.get(key), "an object, or null")
    # Both present: transformers 5 takes rope_scaling whole and ignores rope_parameters
    # (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict: `rope_scaling or rope_parameters`).
    where = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(where) or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling: dict[str, Any] = {}
    max_len = hf.get("max_position_embeddings", 2048)  # (transformers' LlamaConfig default)
    _require(_is_int(max_len) and max_len > 0, "max_position_embeddings", max_len, "a positive int")
    window = hf.get("sliding_window")
    # A window that spans every position the model takes is full attention (transformers'
    # mask keeps keys with q - window < k <= q): such configs load.
    if window is not None:
        _require(_is_int(window) and window > 0, "sliding_window", window, "a positive int, or null")
        if window < max_len:
            raise HFFormatError(f"sliding_window={window} < max_position_embeddings={max_len}: sliding-window "
                                "attention is not supported (a window of at least max_position_embeddings is full "
                                "attention, and loads)")
    if rope_type == "llama3":
        if "factor" not in rope:
            raise HFFormatError(f"rope_type='llama3' without its factor: {rope}")
        # Missing low/high factors take the constants of Meta's reference (apply_scaling in
        # llama-models: 1 and 4); a missing original length is max_position_embeddings, as in
        # transformers' _compute_llama3_parameters.
        factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
        original = rope.get("original_max_position_embeddings", max_len)
        _require(_is_number(factor) and factor >= 1, f"{where}.factor", factor, "a number >= 1 (llama3 divides the long "
                 "wavelengths' frequencies by it)")
        _require(_is_number(low) and _is_number(high) and 0 < low < high, f"{where}.low_freq_factor/high_freq_factor",
                 (low, high), "numbers with 0 < low < high (the ramp between divides by high - low)")
        _require(_is_int(original) and original > 0, f"{where}.original_max_position_embeddings", original,
                 "a positive int")
        scaling = dict(rope_scaling_factor=float(factor), rope_low_freq_factor=float(low),
                       rope_high_freq_factor=float(high), rope_original_max_len=original)
    elif rope_type not in ("default", None):
        raise HFFormatError(f"rope_type={rope_type!r} is not supported (default and llama3 are)")
    for key, value in (("rope_theta", theta), ("rms_norm_eps", hf.get("rms_norm_eps", 1e-6))):
        _require(_is_number(value) and value > 0, key, value, "a positive finite number")
    tie = hf.get("tie_word_embeddings", False)
    _require(isinstance(tie, bool), "tie_word_embeddings", tie, "true or false")
    if param_dtype is None:
        # (transformers 5 writes dtype, 4.x torch_dtype; either may be there as null)
        param_dtype = {"bfloat16": DType.bfloat16, "float16": DType.float16}.get(
            hf.get("dtype") or hf.get("torch_dtype"), DType.float32
        )
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=n,
        num_kv_heads=kv,
        head_dim=head_dim,
        mlp_dim=hf["intermediate_size"],
        max_seq_len=max_len,
        rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=tie,
        init_std=float(hf.get("initializer_range") or 0.02),  # (only a new model's init reads it)
        param_dtype=param_dtype,
        **scaling,
    )


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    rope_theta = cfg.rope_theta
    rope_scaling = None
    if cfg.rope_scaling_factor:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        # (explicit: without them transformers' LlamaConfig reads bos 1 and eos 2, and its generate
        # stopped at token 2, which our models do not treat as an end; save(tokenizer=) sets eos)
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# ------------------------------------------------------------------------------ load


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of cfg holds, name -> shape (HF's [out, in] for the linears)."""
    d, n, k, h, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                        cfg.vocab_size)
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n * h, d),
            p + "self_attn.k_proj.weight": (k * h, d),
            p + "self_attn.v_proj.weight": (k * h, d),
            p + "self_attn.o_proj.weight": (d, n * h),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def _unused_ok(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that the model rightly does not read: RoPE's inverse
    frequencies (older saves keep the buffer; ours follow from the config) and, with tied
    embeddings, lm_head.weight equal to the embedding (check_hf_tensors refuses one that differs)."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _same(a, b, rows: int = 8192) -> bool:
    """Equal shapes and values, compared a block of rows at a time (a vocabulary-sized
    comparison at once would hold a bool per element: 0.5 GB for a 128k x 4k embedding)."""
    if a is b:
        return True
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and all(np.array_equal(a[i:i + rows], b[i:i + rows]) for i in range(0, len(a), rows))


def check_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> None:
    """HFFormatError naming the tensors that are missing, have another shape than config.json
    gives them, or would not be read (more layers than num_hidden_layers, biases), and a tied
    config's lm_head.weight that is not the embedding: each would load a model that computes
    something other than the checkpoint's."""
    want = hf_tensor_shapes(cfg)
    missing = [name for name in want if name not in tensors]
    if missing:
        hint = " (config.json's tie_word_embeddings is false)" if missing == ["lm_head.weight"] else ""
        raise HFFormatError(f"tensors missing from the checkpoint: {_names(missing)}{hint}")
    wrong = [f"{name} is {tuple(tensors[name].shape)}, config.json gives {shape}" for name, shape in want.items()
             if tuple(tensors[name].shape) != shape]
    if wrong:
        raise HFFormatError("tensor shapes do not match config.json: " + "; ".join(wrong[:5])
                            + (f"; and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    # Integer or bool weights (a quantized checkpoint) would be cast to floats as they are:
    # a model of the raw codes, without their scales.
    dtypes = {name: np.asarray(tensors[name]).dtype for name in want}
    ints = [f"{name} ({dt})" for name, dt in dtypes.items() if dt.kind in "iub"]
    if ints:
        raise HFFormatError(f"tensors that are not floating point (a quantized checkpoint? only float16, bfloat16 "
                            f"and float32 weights load): {_names(ints)}")
    extra = sorted(name for name in tensors if name not in want and not _unused_ok(name, cfg))
    if extra:
        raise HFFormatError(f"tensors the model would not read (config.json: {cfg.num_layers} layers, no biases): "
                            f"{_names(extra)}")
    # Tied, with a head that is not the embedding: transformers 5.24 then leaves the two untied (it
    # warns), 4.x ties them into one; we had taken the embedding silently. config.json must say which.
    head, embed = tensors.get("lm_head.weight"), tensors["model.embed_tokens.weight"]
    if cfg.tie_embeddings and head is not None and not _same(head, embed):
        raise HFFormatError("tie_word_embeddings=true, but lm_head.weight is not model.embed_tokens.weight "
                            "(transformers 5 loads the two untied, 4.x ties them into one); allowed: "
                            "tie_word_embeddings=false in config.json to load the head, or a checkpoint without "
                            "lm_head.weight (or with it equal) to tie them")


def _stack(tensors, names):
    return np.stack([np.asarray(tensors[n]) for n in names])


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
    """HF tensors -> our parameter pytree (numpy, the checkpoint's dtype); HFFormatError where the
    tensors are not those of cfg (check_hf_tensors)."""
    d, n, k, h, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.num_layers
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if cfg.tie_embeddings and embed not in tensors and head in tensors:
        # A tied checkpoint that keeps the one matrix under the head's name: transformers 5 loads it
        # (tying fills the embedding from it); it had been refused as missing its embedding.
        tensors = {**tensors, embed: tensors[head]}
    check_hf_tensors(cfg, tensors)

    def get(name):
        return tensors[name]

    def layer(name):
        return [f"model.layers.{i}.{name}" for i in range(L)]

    def lin(name, shape):  # [out, in] -> [in, *shape]
        return np.stack([np.asarray(get(x)).T.reshape(shape) for x in layer(name)])

    params = {
        "embed": {"table_vd": np.asarray(get("model.embed_tokens.weight"))},
        "blocks": {
            "attn_norm": {"scale": _stack(tensors, layer("input_layernorm.weight"))},
            "attn": {
                "q_dnh": lin("self_attn.q_proj.weight", (d, n, h)),
                "k_dkh": lin("self_attn.k_proj.weight", (d, k, h)),
                "v_dkh": lin("self_attn.v_proj.weight", (d, k, h)),
                "o_nhd": lin("self_attn.o_proj.weight", (n, h, d)),
            },
            "mlp_norm": {"scale": _stack(tensors, layer("post_attention_layernorm.weight"))},
            "mlp": {
                "gate_df": lin("mlp.gate_proj.weight", (d, cfg.mlp_dim)),
                "up_df": lin("mlp.up_proj.weight", (d, cfg.mlp_dim)),
                "down_fd": lin("mlp.down_proj.weight", (cfg.mlp_dim, d)),
            },
        },
        "final_norm": {"scale": np.asarray(get("model.norm.weight"))},
    }
    if not cfg.tie_embeddings:
        params["head_dv"] = np.asarray(get("lm_head.weight")).T
    return params


def load(path: str | os.PathLike, *, param_dtype: DType | str | None = None,
         attention: AttentionConfig = AttentionConfig()) -> tuple[ModelConfig, Transformer]:
    """A local HF Llama-family directory (config.json + safetensors) -> (config, model).

    param_dtype: the dtype to hold the weights in; None keeps the checkpoint's config dtype.
    """
    if param_dtype is not None:
        name = getattr(param_dtype, "value", param_dtype)  # (a DType or its name)
        if name not in PARAM_DTYPES:
            raise ValueError(f"param_dtype={param_dtype!r}; allowed: {', '.join(PARAM_DTYPES)}, or None (config.json's)")
        param_dtype = DType(name)
    path = Path(path)
    if not path.is_dir():
        raise HFFormatError(f"{path}: no such directory")
    if not (path / "config.json").exists():
        raise HFFormatError(f"{path} has no config.json")
    hf = _read_json(path / "config.json")
    cfg = config_from_hf(hf, param_dtype=param_dtype)
    tensors = _read_all_tensors(path)
    params = params_from_hf(cfg, tensors)
    return cfg, from_params(cfg, params, attention=attention)


def from_params(cfg: ModelConfig, params: dict, *, attention: AttentionConfig = AttentionConfig()) -> Transformer:
    """Build a Transformer whose parameters are `params` (a pure pytree), cast to param_dtype."""
    from scaling.model import resolve_dtype

    abstract = nnx.eval_shape(lambda: Transformer(cfg, attention=attention, rngs=nnx.Rngs(params=0)))
    graphdef, state = nnx.split(abstract)
    want = nnx.to_pure_dict(state)
    pdt = resolve_dtype(cfg.param_dtype)

    def put(path, a, w):
        if tuple(a.shape) != tuple(w.shape):
            raise HFFormatError(f"{jax.tree_util.keystr(path)}: checkpoint shape {a.shape}, model shape {w.shape}")
        return jnp.asarray(np.asarray(a).astype(pdt))

    filled = jax.tree_util.tree_map_with_path(put, params, want)
    nnx.replace_by_pure_dict(state, filled)
    return nnx.merge(graphdef, state)


# ------------------------------------------------------------------------------ save


def params_to_hf(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    d, n, k, h, L = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.num_layers
    b = params["blocks"]
    out = {
        "model.embed_tokens.weight": params["embed"]["table_vd"],
        "model.norm.weight": params["final_norm"]["scale"],
    }
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = b["attn_norm"]["scale"][i]
        out[p + "post_attention_layernorm.weight"] = b["mlp_norm"]["scale"][i]
        out[p + "self_attn.q_proj.weight"] = b["attn"]["q_dnh"][i].reshape(d, n * h).T
        out[p + "self_attn.k_proj.weight"] = b["attn"]["k_dkh"][i].reshape(d, k * h).T
        out[p + "self_attn.v_proj.weight"] = b["attn"]["v_dkh"][i].reshape(d, k * h).T
        out[p + "self_attn.o_proj.weight"] = b["attn"]["o_nhd"][i].reshape(n * h, d).T
        out[p + "mlp.gate_proj.weight"] = b["mlp"]["gate_df"][i].T
        out[p + "mlp.up_proj.weight"] = b["mlp"]["up_df"][i].T
        out[p + "mlp.down_proj.weight"] = b["mlp"]["down_fd"][i].T
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["head_dv"].T
    return out


def save(model_config: ModelConfig, model: Transformer, path: str | os.PathLike, *, dtype=None,
         tokenizer=None) -> Path:
    """Write config.json + model.safetensors (transformers' LlamaForCausalLM loads them).

    dtype: the dtype of the written weights; None keeps the model's parameter dtype.
    tokenizer: None, or one of our tokenizers (`scaling.data.BPETokenizer` / `ByteTokenizer`) or
    the path of a run's `tokenizer.json`: written with `save_tokenizer`, so the directory is a
    whole model transformers' AutoTokenizer and our `generate` CLI can use.
    """
    params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return save_params(model_config, params, path, dtype=dtype, tokenizer=tokenizer)


def _check_model_config(model_config) -> None:
    """A whole `Config` (or anything else) in place of its `.model` had failed on an attribute
    deep inside: name the argument and what it takes."""
    if isinstance(model_config, Config):
        raise TypeError("model_config: got a whole Config; pass its .model (a ModelConfig), e.g. save(cfg.model, model, path)")
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config: takes a ModelConfig, got {type(model_config).__name__}")


def _check_params_match(cfg: ModelConfig, params: dict) -> None:
    """ValueError naming the parameters that a model of `cfg` lacks, has no place for, or holds in
    another shape. A config other than the model's had been written beside its weights: 4 heads of
    8 saved as 8 of 4, or an untied head dropped under tie_word_embeddings, loading as another model."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))[0]}
    got = {jax.tree_util.keystr(k): tuple(np.shape(v)) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    problems = [f"{k} missing" for k in want if k not in got] + [f"{k} not in such a model" for k in got if k not in want]
    problems += [f"{k} is {got[k]}, the config gives {want[k]}" for k in want if k in got and got[k] != want[k]]
    if problems:
        raise ValueError("the parameters are not those of model_config: " + "; ".join(problems[:5])
                         + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))


def save_params(model_config: ModelConfig, params: dict, path: str | os.PathLike, *, dtype=None,
                tokenizer=None) -> Path:
    """`save` from a pure dict of params (a checkpoint's, `scaling.checkpoint.load_params`)."""
    _check_model_config(model_config)
    path = Path(path)
    if tokenizer is not None:
        tokenizer = _as_tokenizer(tokenizer)
        if tokenizer.vocab_size > model_config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                             f"vocab_size {model_config.vocab_size}")
    params = jax.device_get(params)
    _check_params_match(model_config, params)
    names = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16"}
    by_name = {v: k for k, v in names.items()}
    if dtype is None:
        dt = np.asarray(jax.tree.leaves(params)[0]).dtype
    else:
        dt = by_name.get(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    if dt not in names:
        raise ValueError(f"dtype={dtype!r}: cannot save weights as that; allowed: {', '.join(names.values())}")
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(dt)) for k, v in params_to_hf(model_config, params).items()}
    hf_config = config_to_hf(model_config, names[dt])
    if tokenizer is not None:
        hf_config["eos_token_id"] = int(tokenizer.eos_id)
        save_tokenizer(tokenizer, path, model_max_length=model_config.max_seq_len)
    # config.json goes last: a save cut short (a full disk, Ctrl-C) leaves a directory without it,
    # which every loader refuses, never a config beside weights of another model or half of them.
    (path / "config.json").unlink(missing_ok=True)
    write_safetensors(path / "model.safetensors", tensors)
    _remove_stale_shards(path)
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(hf_config, indent=2) + "\n")
    tmp.replace(path / "config.json")
    return path


# transformers' shard names (save_pretrained's "model-00001-of-00002.safetensors")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _remove_stale_shards(path: Path) -> None:
    """A sharded checkpoint saved earlier in `path`: its index and shards, which tools that follow
    the index (vLLM) would load in place of the model.safetensors just written. transformers'
    save_pretrained removes a previous save's shards too."""
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    for f in path.iterdir():
        if _SHARD.fullmatch(f.name) and f.is_file():
            f.unlink()


# ------------------------------------------------------------------------- tokenizer


def _as_tokenizer(tokenizer):
    from scaling.data import load_tokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(Path(tokenizer))
    if not hasattr(tokenizer, "eos_id") or not hasattr(tokenizer, "vocab_size"):
        raise TypeError(f"tokenizer: expected a scaling.data tokenizer or a tokenizer.json path, got {type(tokenizer).__name__}")
    return tokenizer


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character (bytes that print as
    themselves keep their code point; the rest map to 256, 257, ... in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_as_hf():
    """Our ByteTokenizer (ids = UTF-8 byte values, EOS = 256) as a HF `tokenizers.Tokenizer`:
    a byte-level BPE without merges whose vocabulary puts each byte at its own value."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from scaling.data import BPETokenizer, ByteTokenizer

    vocab = {ch: b for b, ch in _byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BPETokenizer.EOS, special=True)])
    assert tok.token_to_id(BPETokenizer.EOS) == ByteTokenizer.eos_id
    return tok


def save_tokenizer(tokenizer, path: str | os.PathLike, *, model_max_length: int | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json for HF tools.

    tokenizer: one of our tokenizers or a run's tokenizer.json path. A BPE tokenizer's file is
    already HF's format; the byte tokenizer is written as an equivalent byte-level BPE
    (`byte_tokenizer_as_hf`). Our models train without BOS, with `<|eos|>` between documents,
    which is also the stop token and (for batched HF generation) the pad token.
    """
    from scaling.data import BPETokenizer, ByteTokenizer

    tokenizer = _as_tokenizer(tokenizer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, ByteTokenizer):
        hf_tok = byte_tokenizer_as_hf()
    elif isinstance(tokenizer, BPETokenizer):
        hf_tok = tokenizer.tok
    else:
        raise TypeError(f"tokenizer: cannot write a {type(tokenizer).__name__} in HF's format")
    hf_tok.save(str(path / "tokenizer.json"))
    eos = int(tokenizer.eos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": BPETokenizer.EOS,
        "pad_token": BPETokenizer.EOS,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": eos, "pad_token_id": eos}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return path
