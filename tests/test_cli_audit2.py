"""`python -m scaling` start-up (help and usage errors load no JAX, scipy or Flax) and `generate`
on a Hugging Face directory: generation_config.json's stop ids and sampling defaults, as
transformers' generate reads them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_hf_mutants import _successor_hf_dir

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ start-up

# Runs each command line in one interpreter, in order, and reports what each newly imported. The
# commands that must stay light come first: a module one of them imports is not seen again later.
_WRAPPER = r"""
import contextlib, io, json, sys
from scaling.__main__ import main
out = {}
for argv in json.loads(sys.argv[1]):
    before = set(sys.modules)
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    new = set(sys.modules) - before
    out[" ".join(argv)] = {"rc": rc, "usage": "usage:" in text.getvalue(),
                           "packages": sorted({m.split(".")[0] for m in new}),
                           "scaling": sorted(m for m in new if m.startswith("scaling."))}
print(json.dumps(out))
"""
LIGHT = {  # command line -> exit status
    "help": 0, "help fit": 0, "fit --help": 0, "fit --results x --bootstrap -1": 2, "generate --help": 0,
    "generate": 2, "generate --checkpoint x --prompt a --top-k nine": 2, "train --help": 0, "shardings --help": 0,
    "trian": 2,
}
HEAVY = {"jax", "jaxlib", "flax", "optax", "orbax", "scipy", "numpy", "tokenizers"}


@pytest.fixture(scope="module")
def imported():
    cmds = [c.split() for c in LIGHT] + [["plan", "--help"], ["sweep", "--help"]]
    out = subprocess.run([sys.executable, "-c", _WRAPPER, json.dumps(cmds)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_help_and_usage_errors_load_no_jax_scipy_or_flax(imported):
    """`fit --help` imported scipy.optimize and numpy first (0.7 s where the rest takes 0.15): a
    user asking for help or mistyping a flag waits for none of them."""
    for cmd, rc in LIGHT.items():
        got = imported[cmd]
        assert (got["rc"], got["usage"]) == (rc, True), (cmd, got)
        assert not HEAVY & set(got["packages"]), (cmd, got["packages"])


def test_plan_help_loads_neither_the_accounting_nor_flax(imported):
    """plan imported scaling.accounting (and through it scaling.sharding, Flax) before reading its
    arguments; now only scaling.hardware, whose table --help lists."""
    got = imported["plan --help"]
    assert (got["rc"], got["usage"]) == (0, True)
    assert got["scaling"] == ["scaling.hardware", "scaling.plan"] and "flax" not in got["packages"], got


def test_plan_help_loads_no_jax(imported):
    """scaling/hardware.py had imported jax at its top, used only by detect()."""
    assert "jax" not in imported["plan --help"]["packages"]


def test_sweep_help_loads_no_jax(imported):
    """sweep reads the accounting, which imported scaling.sharding's mesh helpers (jax) for one
    small function; they load on first use now (1.7 s -> 0.4 s)."""
    got = imported["sweep --help"]
    assert (got["rc"], got["usage"]) == (0, True)
    assert not {"jax", "flax", "optax", "orbax"} & set(got["packages"]), got["packages"]


# --------------------------------------------------------------------- generate, HF stop ids


def test_stop_ids_are_generation_configs_where_it_sets_them(tmp_path, capsys):
    """config.json eos 0x21 ('!', as a config.json saved with LlamaConfig's default eos names an
    ordinary token) and generation_config.json eos 256: transformers stops at 256 alone; the union
    had stopped at '!'. A generation_config.json without eos_token_id leaves config.json's."""
    from scaling.generate_cli import _hf_stop_ids, main

    d = _successor_hf_dir(tmp_path, config_eos=0x21, generation_eos=256)
    assert _hf_stop_ids(d) == [256]
    assert main(["--checkpoint", str(d), "--prompt", "a", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == "aé!✓\n"  # (the union: "aé")
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert _hf_stop_ids(d) == [0x21]


# ---------------------------------------------------------------- generate, HF sampling defaults

LLAMA3_INSTRUCT = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}  # (its generation_config.json's sampling)


def _flags(temperature=None, top_k=None, top_p=None):
    return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p)


@pytest.mark.parametrize("gen,flags,want,taken", [
    # the file's when sampling; transformers' temperature 1.0 where it sets none; no top_k=50 added
    (LLAMA3_INSTRUCT, {}, (0.6, None, 0.9), ["do_sample=true", "temperature=0.6", "top_p=0.9"]),
    ({"do_sample": True}, {}, (1.0, None, None), ["do_sample=true", "temperature=1.0 (unset: transformers' default)"]),
    ({"do_sample": True, "top_k": 20, "top_p": None}, {}, (1.0, 20, None), None),
    ({"do_sample": True, "top_k": 0}, {}, (1.0, None, None), None),  # (0: no top-k, as in transformers)
    # do_sample false or unset: greedy whatever the temperature says
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, {}, (0.0, None, None), []),
    ({"temperature": 0.6}, {}, (0.0, None, None), []),
    ({}, {}, (0.0, None, None), []),
    # a flag wins: --temperature 0 is greedy, a positive one samples with the file's top_k/top_p
    (LLAMA3_INSTRUCT, {"temperature": 0.0}, (0.0, None, None), []),
    (LLAMA3_INSTRUCT, {"top_p": 0.5}, (0.6, None, 0.5), ["do_sample=true", "temperature=0.6"]),
    ({"do_sample": False, "top_k": 40, "top_p": 0.9}, {"temperature": 0.8}, (0.8, 40, 0.9), ["top_k=40", "top_p=0.9"]),
    ({**LLAMA3_INSTRUCT, "top_k": 7}, {"temperature": 0.8, "top_k": 3}, (0.8, 3, 0.9), ["top_p=0.9"]),
])
def test_sampling_settings_follow_generation_config(gen, flags, want, taken):
    from scaling.generate_cli import sampling_settings

    got, got_taken = sampling_settings(_flags(**flags), gen)
    assert (got["temperature"], got["top_k"], got["top_p"]) == want
    if taken is not None:
        assert got_taken == taken


def test_sampling_settings_name_a_bad_value_they_take():
    from scaling.generate_cli import sampling_settings
    from scaling.interop.hf import HFFormatError

    for gen, msg in (({"do_sample": "yes"}, "do_sample='yes'; allowed: true or false (or give --temperature)"),
                     ({"do_sample": True, "temperature": -1}, "temperature=-1; allowed: a finite number >= 0"),
                     ({"do_sample": True, "top_k": 2.5},
                      "top_k=2.5; allowed: an int >= 0 (0: no top-k) (or give --top-k)"),
                     ({"do_sample": True, "top_p": 0}, "top_p=0; allowed: a number in (0, 1] (or give --top-p)")):
        with pytest.raises(HFFormatError, match="^" + re.escape("g.json: " + msg)):
            sampling_settings(_flags(), gen, "g.json")
    # not taken, not read: a flag over it, or a greedy file
    assert sampling_settings(_flags(top_k=3), {"do_sample": True, "top_k": "x"})[0]["top_k"] == 3
    assert sampling_settings(_flags(), {"do_sample": False, "temperature": "hot"})[0]["temperature"] == 0.0


def test_cli_takes_generation_configs_sampling_and_says_so(tmp_path, capsys, monkeypatch):
    """The CLI had decoded greedily where transformers' generate samples (Llama 3 Instruct's
    do_sample, temperature 0.6, top_p 0.9). Now the decoder gets the file's settings, stderr names
    them, --temperature 0 forces greedy (and says nothing of the file), the file's top_k over the
    vocabulary keeps all of it, and a bad value is refused before the weights load."""
    from scaling import decode, generate_cli

    seen = []
    monkeypatch.setattr(decode.Decoder, "stream", lambda self, prompts, n, **kw: seen.append(kw) or iter(()))
    d = _successor_hf_dir(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({**LLAMA3_INSTRUCT, "top_k": 1000, "eos_token_id": 256}))
    run = ["--checkpoint", str(d), "--prompt", "a", "--max-new-tokens", "2"]
    assert generate_cli.main(run) == 0
    assert (seen[-1]["temperature"], seen[-1]["top_k"], seen[-1]["top_p"]) == (0.6, 257, 0.9)
    assert (f"sampling from {d}/generation_config.json: do_sample=true, temperature=0.6, top_k=1000, top_p=0.9 "
            "(a flag overrides each; --temperature 0 is greedy)\n") in capsys.readouterr().err
    assert generate_cli.main(run + ["--temperature", "0"]) == 0
    assert seen[-1]["temperature"] == 0.0 and "generation_config" not in capsys.readouterr().err
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": "hot"}))
    monkeypatch.setattr(generate_cli, "load_any", lambda *a: pytest.fail("loaded the weights first"))
    assert generate_cli.main(run) == 2
    assert f"error: {d}/generation_config.json: temperature='hot'; allowed" in capsys.readouterr().err
