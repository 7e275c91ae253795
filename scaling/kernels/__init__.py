"""Pallas kernels, each with a pure-jnp reference."""

from scaling.kernels.flash_attention import BLOCK_SIZE_TABLE, BlockSizes, default_block_sizes, flash_attention
from scaling.kernels.flash_attention_mgpu import MosaicConfig
from scaling.kernels.flash_attention_mgpu_bwd import MosaicBwdConfig
from scaling.kernels.reference import attention_reference

__all__ = ["BLOCK_SIZE_TABLE", "BlockSizes", "MosaicBwdConfig", "MosaicConfig", "attention_reference", "default_block_sizes", "flash_attention"]
