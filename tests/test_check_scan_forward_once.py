"""experiments/check_scan_forward_once.py's HLO reader: counts the attention kernels' forward
custom calls (a cloned one too), not their backward or other custom calls."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import check_scan_forward_once as C  # noqa: E402

FWD = ('  %mpmd_map.22 = (bf16[4,2048,16,64]{3,2,1,0}, f32[4,16,2048]{2,1,0}) custom-call(%a, %b, %c), '
       'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(step_fn)/jvp()/while/body/eval_jaxpr/'
       'jit(_forward)/jit(_call)/anonymous/mpmd_map"}')
BWD = ('  %mpmd_map.28 = bf16[4,2048,16,64]{3,2,1,0} custom-call(%a, %b), custom_call_target="mosaic_gpu_v2", '
       'metadata={op_name="jit(step_fn)/transpose(jvp())/while/body/eval_jaxpr/jit(_backward)/anonymous/mpmd_map"}')
GEMM = ('  %custom-call.3 = (bf16[8192,1024]{1,0}, s8[33554432]{0}) custom-call(%x, %y), '
        'custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step_fn)/jvp()/while/body/jit(_forward)/dot_general"}')


def test_counts_forward_kernel_calls_only():
    assert C.forward_calls("\n".join([FWD, BWD, GEMM])) == 1
    assert C.forward_calls("\n".join([FWD, FWD.replace("mpmd_map.22", "mpmd_map.27"), BWD])) == 2
    assert C.forward_calls(BWD + "\n" + GEMM) == 0
