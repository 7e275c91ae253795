"""Meta's Llama 3 RoPE frequency scaling, the tests' independent reference (float64).

`apply_scaling` in meta-llama/llama-models (models/llama3/reference_impl/model.py), the same as
transformers' `_compute_llama3_parameters`, written out one frequency at a time: wavelengths
shorter than original_len / high are kept, longer than original_len / low divided by factor,
and a linear blend in 1/wavelength between.
"""

from __future__ import annotations

import math

import numpy as np


def meta_llama3_inv_freq(theta, head_dim, factor, low, high, original_len) -> tuple[np.ndarray, list[str]]:
    """The scaled inverse frequencies theta^(-2i/H), and which band each fell in."""
    base = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = original_len / low, original_len / high
    out, bands = [], []
    for freq in base:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
            bands.append("kept")
        elif wavelen > low_wavelen:
            out.append(freq / factor)
            bands.append("divided")
        else:
            smooth = (original_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
            bands.append("blended")
    return np.array(out), bands
