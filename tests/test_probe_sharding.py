"""Input checks of the sharding layer and the multi-host start-up, as a user meets them.

Every case here was a silent misbehaviour, a Python traceback or an unhelpful message before:
- multi-host settings that cannot work (a process count without an address, an address or a
  process id without a count, a count below 1, a flag and a variable that disagree, a
  non-integer variable, an address without a port) ran single-process or crashed inside
  jax.distributed; a process id out of range was a plain ValueError, a traceback on the
  command line;
- a MeshConfig built in Python (no config validation) with 0, -2 or two -1 sizes gave a
  ZeroDivisionError or a negative mesh shape; make_mesh took an empty or duplicated device
  list;
- logical_to_spec split a rule given as a bare string into its characters and raised a bare
  KeyError for a mesh axis the mesh lacks;
- param_shardings silently truncated (zip) when a parameter had fewer logical names than
  dimensions;
- the divisibility error did not name the config fields or the sizes that would work.
All checks are pure Python or abstract (no compile): the file takes a few seconds.
"""

from __future__ import annotations

import ast
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from scaling.config import MeshConfig, load_config
from scaling.sharding import MeshError, ShardingError, get_rule_set, logical_to_spec, make_mesh, resolve_mesh_shape

TINY = "configs/models/tiny.yaml"
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


# ----------------------------------------------------------------------------- multi-host


@pytest.fixture
def no_distributed(monkeypatch):
    """Clean JAX_* variables, and jax.distributed.initialize replaced by a recorder: a refused
    setting must never reach it (the old code did, and would hang or start a coordinator)."""
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a, **kw: None)  # (gloo switch: keep this process as is)
    return calls


BAD_MULTIHOST = [
    # (flags, environment, what the message must say)
    (dict(num_processes=2, process_id=1), {}, r"mesh\.num_processes \(set to 2\) needs the coordinator's HOST:PORT in mesh\.coordinator_address \(or JAX_COORDINATOR_ADDRESS\)"),
    (dict(), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, r"JAX_NUM_PROCESSES \(set to 2\) needs the coordinator's HOST:PORT"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=0, process_id=0), {}, r"mesh\.num_processes \(set to 0\) must be >= 1"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=-2, process_id=0), {}, r"mesh\.num_processes \(set to -2\) must be >= 1"),
    (dict(coordinator_address="127.0.0.1:1234", process_id=1), {}, r"mesh\.coordinator_address \(set to 127\.0\.0\.1:1234\) and mesh\.process_id \(set to 1\) given without the process count"),
    (dict(process_id=3), {}, r"mesh\.process_id \(set to 3\) given without the process count; set mesh\.num_processes"),
    (dict(), {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, r"JAX_COORDINATOR_ADDRESS \(set to 10\.0\.0\.1:1234\) given without the process count"),
    (dict(num_processes=1, process_id=1), {}, r"mesh\.process_id \(set to 1\) must be 0 with mesh\.num_processes \(set to 1\)"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2), {}, r"mesh\.process_id \(set to 2\) must be in \[0, 2\)"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=-1), {}, r"mesh\.process_id \(set to -1\) must be in \[0, 2\)"),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2), {}, r"mesh\.process_id \(or JAX_PROCESS_ID\) is not set; it must be in \[0, 2\)"),
    (dict(), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"}, r"JAX_PROCESS_ID \(set to 5\) must be in \[0, 2\) with JAX_NUM_PROCESSES \(set to 2\)"),
    (dict(), {"JAX_NUM_PROCESSES": "two"}, r"JAX_NUM_PROCESSES='two' is not an integer"),
    (dict(process_id=0), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, r"mesh\.process_id=0 and JAX_PROCESS_ID='1' disagree"),
    (dict(coordinator_address="a:1", num_processes=2, process_id=0), {"JAX_COORDINATOR_ADDRESS": "b:1"}, r"mesh\.coordinator_address='a:1' and JAX_COORDINATOR_ADDRESS='b:1' disagree"),
    (dict(coordinator_address="127.0.0.1", num_processes=2, process_id=0), {}, r"mesh\.coordinator_address \(set to 127\.0\.0\.1\) must be HOST:PORT"),
    (dict(coordinator_address="127.0.0.1:http", num_processes=2, process_id=0), {}, r"must be HOST:PORT with a port in \[1, 65535\]"),
]


@pytest.mark.parametrize("flags,env,message", BAD_MULTIHOST)
def test_inconsistent_multihost_settings_are_refused(flags, env, message, no_distributed, monkeypatch):
    from scaling.distributed import maybe_initialize

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(MeshError, match=message):
        maybe_initialize(MeshConfig(**flags))
    assert no_distributed == []


@pytest.mark.parametrize("flags,env,expected", [
    (dict(), {}, None),
    (dict(num_processes=1), {}, None),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=1, process_id=0), {}, None),
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1), {}, ("127.0.0.1:1234", 2, 1)),
    (dict(), {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}, ("h:9", 4, 3)),
    # a flag and a variable that agree; the flags and variables mixed
    (dict(process_id=1), {"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, ("h:9", 2, 1)),
    (dict(coordinator_address="[::1]:9"), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, ("[::1]:9", 2, 0)),
])
def test_consistent_multihost_settings_initialize_once(flags, env, expected, no_distributed, monkeypatch):
    import scaling.distributed as dist

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "_initialized", False)
    assert dist.maybe_initialize(MeshConfig(**flags)) is (expected is not None)
    want = [] if expected is None else [dict(zip(("coordinator_address", "num_processes", "process_id"), expected))]
    assert no_distributed == want


def test_cli_reports_a_bad_process_id_in_one_line(no_distributed, tmp_path, capsys):
    """Exit code 2 and the message, no traceback, before the run directory is made."""
    from scaling.__main__ import main

    run_dir = tmp_path / "run"
    argv = ["train", "--config", TINY, "--data.source=synthetic", "--run_dir", str(run_dir),
            "--mesh.coordinator_address=127.0.0.1:1234", "--mesh.num_processes=2", "--mesh.process_id=2"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: multi-host: mesh.process_id (set to 2) must be in [0, 2)") and "Traceback" not in err
    assert not run_dir.exists() and no_distributed == []


# ----------------------------------------------------------------------------- meshes


@pytest.mark.parametrize("cfg,message", [
    (MeshConfig(data=0, fsdp=-1), r"mesh\.data: must be an integer >= 1 or -1"),
    (MeshConfig(data=2, fsdp=-4), r"mesh\.fsdp: must be an integer >= 1 or -1 .*got -4"),
    (MeshConfig(data=-2, fsdp=-4), r"mesh\.data: must be an integer >= 1 or -1 .*got -2"),
    (MeshConfig(data=2.0, fsdp=4), r"mesh\.data: must be an integer >= 1 or -1 .*got 2\.0"),
    (MeshConfig(data=-1, fsdp=-1), r"at most one of mesh\.data, mesh\.fsdp, mesh\.tensor may be -1"),
])
def test_mesh_sizes_are_checked_without_config_validation(cfg, message):
    with pytest.raises(MeshError, match=message):
        resolve_mesh_shape(cfg, 8)


def test_minus_one_error_lists_the_products_that_work():
    # the fixed axes' product must divide the device count: the divisors of 8 / of 12
    for devices, divisors in ((8, "1, 2, 4, 8"), (12, "1, 2, 3, 4, 6, 12")):
        with pytest.raises(MeshError, match=rf"fixed axes \(mesh\.data=1 x mesh\.tensor=5\) multiply to 5.*one of {divisors}$"):
            resolve_mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=5), devices)


def test_make_mesh_refuses_empty_and_duplicated_devices(devices):
    with pytest.raises(MeshError, match="no devices"):
        make_mesh(MeshConfig(), [])
    with pytest.raises(MeshError, match="duplicates"):
        make_mesh(MeshConfig(), [devices[0], devices[1], devices[0], devices[1]])


def test_logical_to_spec_axis_names(devices):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    # A bare string is one mesh axis, not its characters.
    assert logical_to_spec(("batch", None), {"batch": "data"}, mesh) == P("data", None)
    assert logical_to_spec(("batch",), {"batch": "fsdp"}) == P("fsdp")
    # A mesh axis the mesh lacks: named, with the ones it has.
    with pytest.raises(MeshError, match=r"logical axis 'batch' maps to mesh axis 'dat'.*allowed: data, fsdp, tensor"):
        logical_to_spec(("batch",), {"batch": ("dat",)}, mesh)
    # names as a bare string: ("batch") is not a tuple
    with pytest.raises(MeshError, match="sequence of names"):
        logical_to_spec("batch", get_rule_set("default").activations, mesh)


def test_param_names_must_cover_every_dimension(devices):
    from scaling.sharding.params import param_shardings

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    shapes = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}
    with pytest.raises(ShardingError, match=r"parameter w: 1 logical axis names \('embed',\) for a rank-2 array"):
        param_shardings({"w": ("embed",)}, shapes, mesh, get_rule_set("default"))
    with pytest.raises(ShardingError, match=r"parameter w: 3 logical axis names"):
        param_shardings({"w": ("embed", "mlp", None)}, shapes, mesh, get_rule_set("default"))


@pytest.mark.parametrize("overrides,message", [
    # tiny: 2 kv heads; divisors of 2 are 1, 2
    (["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"],
     r"k_dkh: dimension 2 \(kv_heads\) has size 2, which mesh axis tensor of size 4 cannot divide; "
     r"make mesh\.tensor one of 1, 2, or model\.num_kv_heads=2 a multiple of 4"),
    # pure FSDP spreads D over fsdp x tensor; divisors of 100 that divide the 8 devices: 1, 2, 4
    # (5 was suggested too, but fsdp x tensor = 5 is no mesh of 8 devices)
    (["mesh.rules=fsdp", "mesh.fsdp=4", "mesh.tensor=2", "model.hidden_size=100", "model.num_heads=2", "model.num_kv_heads=2"],
     r"dimension 1 \(embed\) has size 100, which mesh axis fsdpxtensor of size 8 cannot divide; "
     r"make mesh\.fsdp x mesh\.tensor one of 1, 2, 4, or model\.hidden_size=100 a multiple of 8"),
])
def test_indivisible_error_names_the_fields_and_the_sizes_that_work(overrides, message, devices):
    from scaling.train import make_setup

    with pytest.raises(ShardingError, match=message):
        make_setup(load_config(TINY, ["data.source=synthetic", *overrides]), devices=devices)


# ----------------------------------------------------------------------------- the report


@pytest.mark.parametrize("rules,mesh", [("default", (2, 2, 2)), ("fsdp", (1, 2, 4)), ("dp", (2, 4, 1)), ("default", (1, 4, 2))])
def test_report_bytes_match_an_independent_count(rules, mesh, devices):
    """Each row's MiB/device is shape / (product of the spec's mesh axes) x 4 bytes,
    recomputed from the printed shape and spec alone; the totals are the rows' sums."""
    from scaling.sharding.report import sharding_report
    from scaling.train import make_setup

    data, fsdp, tensor = mesh
    cfg = load_config(TINY, ["data.source=synthetic", f"mesh.rules={rules}", f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}"])
    lines = sharding_report(make_setup(cfg, devices=devices)).splitlines()
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    assert lines[0] == f"mesh {sizes} rules={rules}"
    total = per_device = 0.0
    rows = lines[3:-2]
    assert len(rows) == 12  # tiny: 4 attention + 3 MLP + 2 block norms, embedding, head, final norm
    for row in rows:
        shape, spec, mib = re.fullmatch(r"\S+\s+(\(.*?\))\s+P\((.*?)\)\s+([\d.,]+)", row).groups()
        shape = ast.literal_eval(shape)
        entries = ast.literal_eval(f"[{spec}]")
        assert len(entries) == len(shape), row
        shards = math.prod(sizes[a] for e in entries if e for a in ((e,) if isinstance(e, str) else e))
        full = math.prod(shape) * 4
        total, per_device = total + full, per_device + full / shards
        np.testing.assert_allclose(float(mib), full / shards / 2**20, atol=0.005)
    assert lines[-1] == (f"params: {total / 2**20:,.2f} MiB total, {per_device / 2**20:,.2f} MiB per device; "
                         f"with AdamW state (x3): {3 * per_device / 2**20:,.2f} MiB per device")


# ------------------------------------------------------------------ shardings --devices N


def test_shardings_over_absent_devices_matches_the_real_mesh_and_the_bytes_by_hand(capsys, monkeypatch):
    """`shardings --devices N` lays a mesh out over N devices that need not exist (a multi-host
    job, a bigger machine). Over the 8 simulated devices it must print what the real mesh prints;
    over 32 its per-device bytes are the shapes divided by hand."""
    from scaling.__main__ import main

    for v in ENV:
        monkeypatch.delenv(v, raising=False)
    base = ["--config", TINY, "--mesh.fsdp=4", "--mesh.tensor=2"]
    assert main(["shardings", *base]) == 0
    real = capsys.readouterr().out
    assert main(["shardings", *base, "--devices", "8"]) == 0
    assert capsys.readouterr().out == real

    assert main(["shardings", "--config", TINY, "--mesh.fsdp=16", "--mesh.data=2", "--devices", "32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mesh {'data': 2, 'fsdp': 16, 'tensor': 1}")
    cfg = load_config(TINY, [])
    m = cfg.model
    d, h = m.hidden_size, m.hidden_size // m.num_heads
    row = next(line for line in out.splitlines() if line.startswith("blocks.attn.q_dnh"))
    # [layers, d, heads, head_dim] in f32, the embed dim split 16 ways (fsdp), data replicates
    assert float(row.split()[-1]) == pytest.approx(round(m.num_layers * d * m.num_heads * h * 4 / 16 / 2**20, 2))
    total = float(re.search(r"params: ([\d,.]+) MiB total", out).group(1).replace(",", ""))
    from scaling import accounting

    assert total == pytest.approx(round(accounting.param_count(m) * 4 / 2**20, 2))


def test_shardings_of_a_multi_host_config_points_to_devices(capsys, monkeypatch):
    from scaling.__main__ import main

    for v in ENV:
        monkeypatch.delenv(v, raising=False)
    assert main(["shardings", "--config", TINY, "--mesh.fsdp=16", "--mesh.num_processes=2"]) == 2
    err = capsys.readouterr().err
    assert "has 16 devices but 8 are available" in err and "pass the whole job's device count as --devices N" in err
    assert main(["shardings", "--config", TINY, "--mesh.fsdp=-1", "--mesh.num_processes=2"]) == 0
    assert capsys.readouterr().out.startswith("(over this machine's 8 devices; --devices N lays out")
    assert main(["shardings", "--config", TINY, "--devices", "0"]) == 2
    assert "--devices must be an int >= 1, got 0" in capsys.readouterr().err
    # the abstract mesh applies the same divisibility rules
    assert main(["shardings", "--config", TINY, "--mesh.tensor=64", "--mesh.fsdp=1", "--devices", "64"]) == 2
    assert "cannot divide" in capsys.readouterr().err
