"""Command line: python -m scaling {train, shardings, plan, generate, sweep, fit, export} ..."""

from __future__ import annotations

import argparse
import os
import sys

from scaling.config import ConfigError, load_config


class _Once(argparse.Action):
    """An option that may be given once: a second --config replaced the first silently
    (a user layering two files got only the second; `inherit:` layers them)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)}, {values}); give one "
                         "(a YAML file can start from another with `inherit: other.yaml`)")
        setattr(namespace, self.dest, values)


def join_spaced_values(items: list[str]) -> list[str]:
    """`--a.b value` (space-separated) -> `--a.b=value`, before the overrides are checked (a value
    alone looked like a stray argument)."""
    merged: list[str] = []
    for item in items:
        if merged and "=" not in merged[-1] and not item.startswith("--"):
            merged[-1] += "=" + item
        else:
            merged.append(item)
    return merged


def _config_args(argv: list[str], prog: str, extra=None):
    """--config FILE [--run_dir DIR] then dotted overrides (--model.num_layers=4 ...)."""
    import dataclasses

    from scaling.config import _SECTIONS, Config

    sections = ", ".join(f.name for f in dataclasses.fields(Config) if f.name in _SECTIONS)
    parser = argparse.ArgumentParser(
        prog=f"python -m scaling {prog}", allow_abbrev=False,
        epilog=f"Config overrides follow as --section.key=value or --section.key value (sections: {sections}; "
               "fields and defaults in scaling/config.py), e.g. --train.steps=50 --model.num_layers=4; "
               "a boolean alone is true (--train.show_shardings).")
    parser.add_argument("--config", default=None, action=_Once, help="YAML file of deltas from the defaults")
    if extra:
        extra(parser)
    args, overrides = parser.parse_known_args(argv)
    merged = join_spaced_values(overrides)
    # (a whole section, `--model={num_layers: 4}`, is an override too: README and parse_overrides)
    bad = [o for o in merged if not o.startswith("--") or
           ("." not in o.split("=", 1)[0] and o[2:].split("=", 1)[0] not in _SECTIONS)]
    if bad:
        parser.error(f"unrecognised arguments {bad}; overrides look like --section.key=value")
    return args, load_config(args.config, merged)


def cmd_train(argv: list[str]) -> int:
    def flags(p):
        p.add_argument("--run_dir", default=None, help="where the run writes (default: runs/<config name>-<timestamp>); "
                       "the same --run_dir again resumes from its latest checkpoint")
        p.add_argument("--profile", action="store_true", help="trace steps [5, 8) unless --profile.steps is given")

    args, cfg = _config_args(argv, "train", flags)
    from scaling.train import NonFiniteError, train  # (after the arguments: `--help` needs no JAX)

    if args.profile and not cfg.profile.steps:
        from scaling.config import replace

        cfg = replace(cfg, profile={"steps": [5, 8]})
    from scaling.checkpoint import CheckpointError

    try:
        summary = train(cfg, args.run_dir, config_path=args.config)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except CheckpointError as e:  # a save that failed (a full disk), no readable checkpoint to resume
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"run directory: {summary['run_dir']}")
    return 0


def _job_processes(cfg) -> int:
    """The job's process count as train would read it (the flag, else JAX_NUM_PROCESSES), 1 when
    unset or unreadable: only a hint here; train checks the settings (scaling.distributed)."""
    value = cfg.mesh.num_processes if cfg.mesh.num_processes is not None else os.environ.get("JAX_NUM_PROCESSES")
    try:
        return int(value or 1)
    except ValueError:
        return 1


def cmd_shardings(argv: list[str]) -> int:
    def flags(p):
        p.add_argument("--devices", type=int, default=None, metavar="N",
                       help="lay the params out over N devices that need not be here (an abstract mesh): "
                            "a multi-host or larger mesh, e.g. --devices 64 --mesh.fsdp=64; "
                            "default: this machine's devices")

    args, cfg = _config_args(argv, "shardings", flags)  # (an unknown mesh.rules is a ConfigError: exit 2)
    import jax  # (after the arguments: `--help` needs no JAX)

    from scaling.sharding import MeshError
    from scaling.sharding.report import abstract_layout, sharding_report
    from scaling.train import make_setup

    if args.devices is not None and args.devices < 1:
        print(f"error: --devices must be an int >= 1, got {args.devices}", file=sys.stderr)
        return 2
    if args.devices is not None:
        print(sharding_report(abstract_layout(cfg, args.devices)))
        return 0
    # A multi-host config's mesh spans every host's devices, which this process does not see.
    multi_host = _job_processes(cfg) > 1
    try:
        setup = make_setup(cfg)
    except MeshError as e:
        if multi_host:
            raise MeshError(f"{e}; for a multi-host mesh pass the whole job's device count as --devices N") from e
        raise
    if multi_host:
        print(f"(over this machine's {len(jax.devices())} devices; --devices N lays out the whole job's mesh)")
    print(sharding_report(setup))
    return 0


COMMANDS = {"train": cmd_train, "shardings": cmd_shardings}


def _lazy(module: str, func: str = "main"):
    def run(argv):
        import importlib

        return importlib.import_module(module).__dict__[func](argv)

    return run


COMMANDS.update(
    plan=_lazy("scaling.plan"),
    generate=_lazy("scaling.generate_cli"),
    sweep=_lazy("scaling.sweep"),
    fit=_lazy("scaling.fit_cli"),
    export=_lazy("scaling.checkpoint", "export_main"),
)


SUMMARIES = {
    "train": "train a model: --config FILE [--section.key=value ...]; resumes in the same --run_dir",
    "shardings": "print every parameter's shape, mesh spec and bytes per device for a config",
    "plan": "the book's accounting for a config: params, FLOPs, memory, communication, roofline [--search]",
    "generate": "stream text from a run directory, an export or a Hugging Face directory",
    "sweep": "train every point of a grid or IsoFLOP sweep spec, resumably (--dry-run to preview)",
    "fit": "fit Kaplan and Chinchilla scaling laws to a sweep's results or a CSV, with plots",
    "export": "write a run's params alone (Orbax), or as a Hugging Face directory (--format hf)",
}


def _usage() -> str:
    lines = ["usage: python -m scaling COMMAND [options]   (python -m scaling COMMAND --help for its options)", ""]
    lines += [f"  {name:<10} {SUMMARIES.get(name, '')}" for name in COMMANDS]
    return "\n".join(lines)


def _unknown(argv: list[str]) -> str:
    """The error line for an argv[0] that is no command, with the likely fix."""
    import difflib
    import shlex

    allowed = f"allowed: {', '.join(COMMANDS)}"
    if argv[0].startswith("-"):  # options before the command (`--config F train`)
        if (later := next((a for a in argv if a in COMMANDS), None)) is None:
            return f"no command before {argv[0]}; {allowed}"
        rest = argv[:argv.index(later)] + argv[argv.index(later) + 1:]
        return f"the command comes first: python -m scaling {later} {shlex.join(rest)}"
    near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
    return f"unknown command {argv[0]!r}; {allowed}" + (f"; did you mean {near[0]!r}?" if near else "")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:  # `help` and `help CMD`, as git and pip take them
        argv = [argv[1], "--help"] if len(argv) > 1 and argv[1] in COMMANDS else ["--help"]
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"error: {_unknown(argv)}", file=sys.stderr)
        print(_usage(), file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return int(COMMANDS[argv[0]](argv[1:]) or 0)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        # Our own input errors (mesh, sharding, checkpoint/config mismatch, remat, HF format)
        # carry full messages; print them without a traceback.
        from scaling.checkpoint import CheckpointMismatchError
        from scaling.remat import RematError
        from scaling.sharding import MeshError, ShardingError

        if isinstance(e, (MeshError, ShardingError, CheckpointMismatchError, RematError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


def _run() -> int:
    try:
        rc = main()
        sys.stdout.flush()  # (inside the try: a piped stdout is block-buffered, written here)
        return rc
    except KeyboardInterrupt:  # Ctrl-C outside train's own handler (setup, generate, plan): no traceback
        print("interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports it
    except BrokenPipeError:
        # The reader went away (`python -m scaling fit ... | head`): stop quietly, as Unix tools
        # do. stdout goes to devnull so that the interpreter's own flush at exit raises nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the signal


if __name__ == "__main__":
    sys.exit(_run())
