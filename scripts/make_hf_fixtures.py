"""Golden fixtures from transformers for tests/test_hf_interop.py; and a check of our `save`.

Runs under a Python that has torch + transformers (not the project's environment), e.g.

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/hfenv/bin/python scripts/make_hf_fixtures.py            # writes tests/fixtures/hf_tiny/
    /tmp/hfenv/bin/python scripts/make_hf_fixtures.py --verify DIR

Fixtures: two randomly initialised tiny f32 `LlamaForCausalLM`s saved with `save_pretrained`
(safetensors), each with input tokens, its logits and transformers' greedy `generate` tokens:

    plain/   hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), head_dim 16, vocab 256, untied
    tied/    hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 32 (!= hidden / heads), vocab 128,
             tied embeddings, llama3 rope scaling with a short original length (32) so the
             scaled frequencies matter at the positions tested

Weights are drawn with std 0.1 (norm scales around 1) so the logits are far from ties and
greedy tokens are stable across implementations.

--verify DIR: DIR holds what tests/test_hf_interop.py's `test_save_loads_in_transformers`
writes (our `save` output + tokens.npy + logits.npy); loads it with transformers and checks
the logits agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_tiny"

VARIANTS = {
    "plain": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False),
    "tied": dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=True,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 32}),
}


def make(name: str, kw: dict, seed: int) -> None:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(rms_norm_eps=1e-5, rope_theta=10000.0, **kw)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d, safe_serialization=True)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=g)
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
        prompts = tokens[:, :7]
        gen = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=16, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    np.save(d / "tokens.npy", tokens.numpy().astype(np.int32))
    np.save(d / "logits.npy", logits.astype(np.float32))
    np.save(d / "greedy.npy", gen[:, 7:].numpy().astype(np.int32))
    (d / "meta.json").write_text(json.dumps({"prompt_len": 7, "torch": torch.__version__,
                                             "transformers": transformers.__version__}, indent=1) + "\n")
    print(f"{name}: {sum(p.numel() for p in model.parameters())} params, greedy {gen[0, 7:].tolist()}")


def verify(d: Path) -> int:
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(d / "tokens.npy")).long()
    ours = np.load(d / "logits.npy")
    with torch.no_grad():
        theirs = model(tokens).logits.float().numpy()
    err = float(np.max(np.abs(theirs - ours)))
    print(f"{d}: transformers {transformers.__version__} loads our save; max |logit diff| {err:.2e}")
    return 0 if err < 1e-4 else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--verify", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.verify is not None:
        return verify(args.verify)
    for i, (name, kw) in enumerate(VARIANTS.items()):
        make(name, kw, seed=i)
    return 0


if __name__ == "__main__":
    sys.exit(main())
