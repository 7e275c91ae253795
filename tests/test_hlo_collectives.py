"""experiments/hlo_collectives.py: its HLO parser against hand-counted text, and a CPU run."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import hlo_collectives as H  # noqa: E402

HLO = """HloModule jit_step

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ag = bf16[16,8]{1,0} all-gather(bf16[8,8]{1,0} %x), dimensions={0}
  %rs = bf16[4,8]{1,0} reduce-scatter(bf16[8,8]{1,0} %g), dimensions={0}
  %ars = f32[2]{0} all-reduce-start(f32[2]{0} %s), to_apply=%add
  %agc = (bf16[4]{0}, bf16[6]{0}) all-gather(bf16[2]{0} %u, bf16[3]{0} %w), dimensions={0}
  %ags = ((bf16[3]{0}), bf16[6]{0}) all-gather-start(bf16[3]{0} %w), dimensions={0}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %y)
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %g2 = f32[8,8]{1,0} all-gather(f32[4,8]{1,0} %a), dimensions={0}
  %a2a = bf16[2,4]{1,0} all-to-all(bf16[2,4]{1,0} %e), dimensions={0}
  %add.1 = f32[8,8]{1,0} add(f32[8,8]{1,0} %g2, f32[8,8]{1,0} %g2)
  ROOT %g3 = f32[8,8]{1,0} all-gather(f32[4,8]{1,0} %b), dimensions={0}
}
"""


def test_collectives_are_counted_by_place_kind_and_dtype():
    got = H.collectives(HLO)
    assert got == {
        # one plain gather, one combined (both outputs count), one async (its outputs only)
        ("loop body", "all-gather", "bf16"): [3, 16 * 8 * 2 + (4 + 6) * 2 + 6 * 2],
        ("loop body", "reduce-scatter", "bf16"): [1, 4 * 8 * 2],
        ("loop body", "all-reduce", "f32"): [1, 2 * 4],  # an async -start counts as its collective
        ("entry", "all-gather", "f32"): [2, 2 * 8 * 8 * 4],
        ("entry", "all-to-all", "bf16"): [1, 2 * 4 * 2],
    }


def test_a_cpu_run_prints_the_meshes_collectives(capsys):
    assert H.main(["--model", "tiny", "--seq", "64", "--batch", "8", "--mesh", "fsdp=8"]) == 0
    out = capsys.readouterr().out
    assert "## mesh {'data': 1, 'fsdp': 8, 'tensor': 1}" in out
    assert "| loop body | all-gather |" in out


NESTED = """HloModule jit_step

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%inner (p: (s32[], bf16[8])) -> (s32[], bf16[8]) {
  %ag = bf16[8]{0} all-gather(bf16[4]{0} %x), replica_groups=[1,2]<=[2], dimensions={0}
  %rs = bf16[4]{0} reduce-scatter(bf16[8]{0} %g), replica_groups=mesh['data'=1,'fsdp'=2] {'fsdp'}, to_apply=%add
}

%outer (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %w = (s32[], bf16[8]) while((s32[], bf16[8]) %t), condition=%cond, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
  %ar = f32[2]{0} all-reduce(f32[2]{0} %y), replica_groups={{0,1}}, to_apply=%add
}

%cond (p: (s32[], f32[2])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %loop = (s32[], f32[2]) while((s32[], f32[2]) %t0), condition=%cond, body=%outer, backend_config={"known_trip_count":{"n":"2"}}
  %rs2 = f32[2]{0} reduce-scatter(f32[8]{0} %h), replica_groups={}, to_apply=%add
  %rs3 = bf16[1]{0} reduce-scatter(bf16[4]{0} %k), replica_groups=[1,4]<=[4], to_apply=%add
  %ags = ((f32[3]{0}), f32[6]{0}) all-gather-start(f32[3]{0} %w), replica_groups=[2,2]<=[4], dimensions={0}
  ROOT %a2a = bf16[4]{0} all-to-all(bf16[4]{0} %e), dimensions={0}
}
"""


def test_step_totals_multiply_loop_bodies_by_their_trips_and_reduce_scatters_by_their_group():
    assert H.multiplicity(H.computations(NESTED)) == {"add": 6 + 2 + 1 + 1, "inner": 6, "outer": 2, "cond": 1 + 2,
                                                     "main": 1}
    assert H.step_totals(NESTED, devices=4) == {
        ("all-gather", "bf16"): 6 * 8 * 2,  # inner runs 2 x 3 times
        ("all-reduce", "f32"): 2 * 2 * 4,
        ("reduce-scatter", "f32"): 2 * 4 * 4,  # empty groups: all 4 devices
        # its input: the output times the fsdp group of 2; + iota groups [1,4]: one group of 4
        ("reduce-scatter", "bf16"): 6 * 4 * 2 * 2 + 1 * 4 * 2,
        ("all-gather", "f32"): 6 * 4,  # an async start: its output, not its operand
        ("all-to-all", "bf16"): 4 * 2,
    }
