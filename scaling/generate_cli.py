"""python -m scaling generate --checkpoint DIR --prompt "..." [--max-new-tokens N --temperature T ...]

DIR is one of our run directories (config.yaml, tokenizer.json, checkpoints/<step>/ written by
Orbax), an export of one (`python -m scaling export`: config.yaml, params/) or a Hugging Face
Llama-family directory (config.json, *.safetensors, tokenizer.json). With one prompt the text streams as it is produced (a chunk of tokens at a
time); with several (repeat --prompt) they decode as one ragged batch and print at the end.
Generation stops at the tokenizer's end-of-sequence token unless --no-stop. A Hugging Face
directory's generation_config.json sets the stop ids and, where a flag does not, the sampling
(do_sample, temperature, top_k, top_p, as transformers' generate reads them); what it set is
said on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from scaling.config import ConfigError


class _HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        from scaling.interop.hf import HFFormatError

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception (had been a traceback)
            raise HFFormatError(f"{path}: cannot read it as a tokenizers file ({e})") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def _hf_stop_ids(d: Path) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list) where that file sets one, as
    transformers' generate reads it, else config.json's. Not both: an Instruct model lists its
    end-of-turn ids in generation_config.json, and a config.json that transformers saved without
    ids holds LlamaConfig's default eos 2, an ordinary token of most vocabularies (the union had
    stopped there). HFFormatError (a ValueError) naming the file if unreadable."""
    from scaling.interop.hf import HFFormatError, _read_json

    for name in ("generation_config.json", "config.json"):
        f = d / name
        eos = _read_json(f).get("eos_token_id") if f.exists() else None
        if eos is None:
            continue
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise HFFormatError(f"{f}: eos_token_id={eos!r}; allowed: a token id or a list of them")
        return sorted(set(ids))
    return []


def _hf_generation_config(d: Path) -> dict:
    """generation_config.json's object ({} without the file; HFFormatError naming it if unreadable)."""
    from scaling.interop.hf import _read_json

    return _read_json(d / "generation_config.json") if (d / "generation_config.json").exists() else {}


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sampling_settings(args, gen: dict, source: str = "generation_config.json") -> tuple[dict, list[str]]:
    """(temperature, top_k, top_p for decode, the 'key=value's taken from `gen`).

    Each flag given wins. Otherwise gen (a generation_config.json) as transformers' generate reads
    it: do_sample true samples, at its temperature (1.0 where it sets none, transformers' default),
    with its top_k (0: none) and top_p where it sets them; do_sample false or unset is greedy
    whatever its temperature says. transformers' top_k=50 for a file that sets none is not added
    (the directory did not ask for it). A positive --temperature samples with the file's top_k and
    top_p, as transformers' generate(do_sample=True) does. A value taken that decode cannot use is
    an HFFormatError naming `source` and the key; one not taken is not read."""
    from scaling.interop.hf import HFFormatError

    taken: list[str] = []

    def take(key, ok, allowed, flag):
        value = gen.get(key)
        if value is not None:
            if not ok(value):
                raise HFFormatError(f"{source}: {key}={value!r}; allowed: {allowed} (or give {flag})")
            taken.append(f"{key}={json.dumps(value)}")
        return value

    if args.temperature is not None:
        temperature = args.temperature
    else:
        do_sample = take("do_sample", lambda v: isinstance(v, bool), "true or false", "--temperature")
        if do_sample is not True:  # (greedy: none of the file's sampling values is used, so none is named)
            return dict(temperature=0.0, top_k=args.top_k, top_p=args.top_p), []
        temperature = take("temperature", lambda v: _is_real(v) and math.isfinite(v) and v >= 0,
                           "a finite number >= 0", "--temperature")
        if temperature is None:
            temperature = 1.0
            taken.append("temperature=1.0 (unset: transformers' default)")
    top_k, top_p = args.top_k, args.top_p
    if temperature > 0:
        if top_k is None:
            top_k = take("top_k", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                         "an int >= 0 (0: no top-k)", "--top-k") or None  # (0: none, as in transformers)
        if top_p is None:
            top_p = take("top_p", lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]", "--top-p")
    return dict(temperature=float(temperature), top_k=top_k, top_p=top_p), taken


def continuation(tok, prompt: list[int], new: list[int], head: str | None = None) -> str:
    """The text `new` adds after `prompt`. Decoded together with the prompt and cut after the
    prompt's text, because decoders treat a sequence's first token specially (SentencePiece's
    Metaspace, as in Llama 2's tokenizer, drops its leading space: "Hello" + "world")."""
    head = tok.decode(prompt) if head is None else head  # (the prompt's text: a streamer decodes it once)
    text = tok.decode(list(prompt) + list(new))
    return text[len(head):] if text.startswith(head) else tok.decode(new)


def load_hf_dir(d: Path):
    from scaling.interop import hf

    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"{d} has no tokenizer.json (the fast-tokenizer file); cannot encode the prompt")
    tok, stop = _HFTokenizer(d / "tokenizer.json"), _hf_stop_ids(d)  # (their errors before the weights load)
    cfg, model = hf.load(d)
    return model, tok, stop


def load_run_dir(d: Path, step: int | None = None):
    """Our run directory -> (model, tokenizer, stop ids), params restored from the checkpoint."""
    from scaling import checkpoint
    from scaling.config import load_config
    from scaling.data import load_tokenizer
    from scaling.interop.hf import from_params

    cfg = load_config(d / "config.yaml")
    if not (d / "tokenizer.json").exists():
        raise FileNotFoundError(f"{d} has no tokenizer.json")
    try:
        tok = load_tokenizer(d / "tokenizer.json")
    except Exception as e:  # noqa: BLE001 - json's errors, a JSON list's AttributeError, tokenizers' bare Exception
        # (had been a traceback, or json's message naming no file)
        raise ValueError(f"{d / 'tokenizer.json'}: cannot read it as a tokenizer ({type(e).__name__}: {e})") from None
    try:
        params = checkpoint.load_params(d, cfg.model, step=step)
    except checkpoint.CheckpointError as e:
        raise ValueError(f"--{e}" if str(e).startswith("step ") else str(e)) from None
    model = from_params(cfg.model, params, attention=cfg.attention)
    eos = getattr(tok, "eos_id", None)
    return model, tok, ([eos] if eos is not None else [])


def _is_hf_dir(d: Path) -> bool:
    return (d / "config.json").exists() and (any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").exists())


def load_any(path: str | Path, step: int | None = None):
    d = Path(path)
    if _is_hf_dir(d):
        if step is not None:
            raise ValueError(f"--step {step}: {d} is a Hugging Face directory (one set of weights); --step picks a run "
                             "directory's checkpoint")
        return load_hf_dir(d)
    if (d / "config.yaml").exists():
        return load_run_dir(d, step)
    raise FileNotFoundError(f"{d} is neither a run directory (config.yaml) nor an HF directory (config.json + safetensors)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scaling generate", description=__doc__.split("\n\n")[1])
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="run directory, its export, or Hugging Face model directory")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: a Hugging Face directory's generation_config.json, do_sample and "
                        "temperature, as transformers reads them; else 0)")
    p.add_argument("--top-k", type=int, default=None,
                   help="default: generation_config.json's top_k when sampling, else none")
    p.add_argument("--top-p", type=float, default=None,
                   help="default: generation_config.json's top_p when sampling, else none")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, 0..2**32-1 (the same seed, the same tokens)")
    p.add_argument("--max-len", type=int, default=None, help="KV cache length (default: prompt + new tokens)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step of a run directory (default: latest)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--chunk", type=int, default=8, help="decode steps between streamed outputs")
    p.add_argument("--layers", default="auto", help="the decode steps' layers (scaling.decode.DecodeLayerImpl: auto, "
                   "xla, pallas, pallas_tma, megakernel); auto runs batch 1 on a Hopper GPU as one kernel where it can")
    p.add_argument("--sampler", default="auto", help="how sampled tokens are drawn: xla (sorts the vocabulary for "
                   "top-k and top-p), pallas (one kernel, no sort, the same tokens) or auto (pallas on a GPU with "
                   "top-k or top-p, where it was measured faster; else xla)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="prompt tokens one prefill call takes at most (default: scaling.decode.PREFILL_TOKENS)")
    return p


def check_flags(args) -> None:
    """ValueError naming the flag whose value decode would refuse, raised before the model loads
    (it had come after: minutes for a large model to learn of --max-new-tokens 0). --top-k's
    upper bound, the vocabulary, is checked once the model is there."""
    from scaling import decode

    checks = (
        ("--max-new-tokens", lambda: decode.check_sampling(args.max_new_tokens)),
        ("--temperature", lambda: args.temperature is None or decode.check_sampling(1, temperature=args.temperature)),
        ("--top-k", lambda: decode.check_sampling(1, top_k=args.top_k)),
        ("--top-p", lambda: decode.check_sampling(1, top_p=args.top_p)),
        ("--seed", lambda: decode.check_sampling(1, seed=args.seed)),
        ("--max-len", lambda: decode.check_decoder_options(max_len=args.max_len)),
        ("--chunk", lambda: decode.check_decoder_options(chunk=args.chunk)),
        ("--layers", lambda: decode.check_decoder_options(layers=args.layers)),
        ("--sampler", lambda: decode.check_decoder_options(sampler=args.sampler)),
        ("--prefill-tokens", lambda: args.prefill_tokens is None
         or decode.check_decoder_options(prefill_tokens=args.prefill_tokens)),
    )
    for flag, check in checks:
        try:
            check()
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from scaling import decode

    try:
        check_flags(args)
        d = Path(args.checkpoint)
        gen_file = d / "generation_config.json"
        # (before the weights load: a bad value is named in seconds, not after minutes)
        sampling, taken = sampling_settings(args, _hf_generation_config(d) if _is_hf_dir(d) else {}, str(gen_file))
        model, tok, stop = load_any(args.checkpoint, args.step)
    except (OSError, ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.top_k is None and sampling["top_k"] is not None:
        # (the file's top_k over the vocabulary keeps all of it, as transformers clamps it)
        sampling["top_k"] = min(sampling["top_k"], model.cfg.vocab_size)
    if taken:
        print(f"sampling from {gen_file}: {', '.join(taken)} (a flag overrides each; --temperature 0 is greedy)",
              file=sys.stderr)
    prompts = [tok.encode(p) for p in args.prompt]
    # (named as the user typed it: decode's "prompt 0 is empty" counts from 0 and knows no text)
    for text, ids in zip(args.prompt, prompts):
        if not ids:
            print(f"error: --prompt {text!r} encodes to no tokens (the tokenizer adds none of its own); give "
                  "at least one character to continue from", file=sys.stderr)
            return 2
    try:
        extra = {} if args.prefill_tokens is None else {"prefill_tokens": args.prefill_tokens}
        dec = decode.Decoder(model, chunk=args.chunk, layers=args.layers, sampler=args.sampler, **extra)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kw = dict(**sampling, seed=args.seed, stop_tokens=() if args.no_stop else stop, max_len=args.max_len)
    if args.max_len is not None:
        # A row stops when its cache is full: say so, rather than end short without a word.
        for i, ids in enumerate(prompts):
            room = args.max_len - len(ids) + 1  # (the last new token is not fed back: it needs no slot)
            if 0 < room < args.max_new_tokens:
                which = f"prompt {i + 1} ({len(ids)} tokens)" if len(prompts) > 1 else f"the prompt ({len(ids)} tokens)"
                print(f"note: --max-len {args.max_len} leaves room for {room} new tokens after {which}, "
                      f"fewer than --max-new-tokens {args.max_new_tokens}", file=sys.stderr)
    try:
        if len(prompts) == 1:
            t0 = time.perf_counter()
            new: list[int] = []
            shown = ""
            head = tok.decode(prompts[0])
            items_stream = dec.stream(prompts, args.max_new_tokens, **kw)  # (bad arguments raise here)
            sys.stdout.write(args.prompt[0])
            try:
                for items in items_stream:
                    for _, toks, _ in items:
                        new += toks
                    text = continuation(tok, prompts[0], [t for t in new if t not in stop], head)
                    # Hold back a trailing partial UTF-8 character until its remaining bytes arrive:
                    # every trailing U+FFFD, as a byte-fallback decoder (Llama 2's) gives one per byte
                    # (holding back one had printed the first of two, and the character was lost).
                    ready = text.rstrip("\ufffd")
                    if ready.startswith(shown):
                        sys.stdout.write(ready[len(shown):])
                        shown = ready
                    sys.stdout.flush()
            except KeyboardInterrupt:
                # Ctrl-C: end the streamed line (the caller's "interrupted" had run on after the text).
                sys.stdout.write("\n")
                sys.stdout.flush()
                raise
            text = continuation(tok, prompts[0], [t for t in new if t not in stop], head)
            sys.stdout.write(text[len(shown):] + "\n")
            dt = time.perf_counter() - t0
            ran = dec._step_layers(dec.bucket(1)).value
            why = f" (no megakernel: {dec.auto_megakernel_reason})" if dec.auto_megakernel_reason else ""
            print(f"[{len(new)} tokens in {dt:.2f}s, {len(new) / dt:.1f} tok/s incl. compile; layers {ran}{why}]",
                  file=sys.stderr)
        else:
            out = dec.generate(prompts, args.max_new_tokens, **kw)
            for text, ids, toks in zip(args.prompt, prompts, out.tokens):
                print(f"=== {text!r}")
                print(text + continuation(tok, ids, [t for t in toks if t not in stop]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
