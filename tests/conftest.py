"""Simulate 8 CPU devices; must run before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def devices():
    assert len(jax.devices()) == 8, "tests/conftest.py must set the 8-device flag before jax is imported"
    return jax.devices()


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory):
    """One tokenized default corpus shared by the data and training tests."""
    return str(tmp_path_factory.mktemp("data-cache"))
