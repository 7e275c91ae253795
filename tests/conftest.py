"""Simulate 8 CPU devices; must run before jax is imported anywhere."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # The tests' tiny programs spend most of their time in compilation: LLVM at -O0 without its
    # expensive passes (jax's own switch; the HLO passes, fusion and buffer assignment are
    # unchanged) cut the suite from 14.5 to 10.9 minutes on 2 cores (thirteenth session).
    # Subprocesses the tests start inherit it. GPU runs (JAX_PLATFORMS=cuda) keep full optimization.
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    # Many tests compile the same programs (the same tiny models, kernels in interpret mode,
    # training children): one persistent compilation cache for the whole run lets each compile
    # once. pytest loads this file before xdist starts its workers, so the workers and the
    # subprocesses the tests start inherit the directory; only the process that made it removes
    # it. A fresh directory per run, so nothing stale is ever read. (An interrupted concurrent
    # write reads as a warning and a recompile in jax, not an error.)
    _cache_dir = tempfile.mkdtemp(prefix="scaling-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Interpret-mode kernels make an io_callback of every memory operation; see _fast_io_callback.py
from _fast_io_callback import install as _install_fast_io_callback  # noqa: E402

FAST_IO_CALLBACK = _install_fast_io_callback()

# The Hopper lowering tests: one pure check of Mosaic GPU's layout inference asked thousands of
# times per kernel; see _memo_mosaic_transfers.py
from _memo_mosaic_transfers import install as _install_mosaic_transfer_memo  # noqa: E402

MEMO_MOSAIC_TRANSFERS = _install_mosaic_transfer_memo()


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set the 8-device flag before jax is imported"
    return jax.devices()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One tokenized default corpus shared by the data and training tests."""
    return str(tmp_path_factory.mktemp("data-cache"))


# Files by their measured time on 2 CPU cores, heaviest first (`pytest --durations=0`, summed per
# file; thirty-fifth session). `./scripts/run test` hands whole files to the two workers
# (`--dist loadfile`) in collection order (`--no-loadscope-reorder`), each taking the next file when
# it finishes: longest-first keeps the last file to start short, so the workers end close together.
# A heavy file that ran last kept the suite waiting for it (14 min 10 s against 12 min 57 s,
# twenty-first session; test_sample_kernel.py, 98 s, unlisted in the thirty-fourth), so files not
# listed here run first: a new file is never the tail, whatever it costs.
HEAVY_FIRST = ("test_decode_megakernel.py", "test_sample_kernel.py", "test_flash_attention_mgpu_bwd.py",
               "test_decode_gemv.py", "test_remat.py", "test_checkpoint.py", "test_decode.py", "test_sweep.py",
               "test_bench_streamk_chain.py", "test_sharding.py", "test_flash_attention_mgpu.py", "test_train.py",
               "test_gpu_lowering.py", "test_multihost.py", "test_chunked_loss.py", "test_scaling_laws.py",
               "test_decode_tma.py", "test_model.py", "test_bench_train.py", "test_flash_attention.py",
               "test_profile_summary.py", "test_bench_weight_stream.py", "test_attention_dispatch.py",
               "test_bench_decode.py", "test_bench_pdl.py", "test_bench_tma_gemv.py", "test_hf_interop.py",
               "test_bench_sample.py", "test_bench_remat.py", "test_bench_grid_barrier.py", "test_accounting.py",
               "test_bench_attention.py", "test_bench_group_exchange.py", "test_data.py", "test_bench_megakernel.py",
               "test_config.py", "test_sm_stream_skew.py", "test_bench_gemv.py", "test_profile_mgpu_bwd.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, -1))  # stable: file order kept within
