"""Rotary position embeddings: the frequencies, their scaled variants, and the rotation.

Head feature pair j (features j and j + hd/2, the "rotate-half" pairing Hugging Face uses) of
the token at position t is rotated by the angle t * freq_j, where

    freq_j = base ** (-2j / hd),  j = 0 .. hd/2 - 1

A model trained on longer contexts than these frequencies were chosen for remaps them once
(`RopeScaling`): "linear" divides them all by a factor; "llama3" divides only the low ones
(long wavelengths, which never completed a turn in the original context) and keeps the high
ones, blending in between. Either way the tables are built once and the rotation is unchanged,
and so is tensor parallelism: every rank rotates its own heads with the same tables.
"""
import math

import torch


def rotary_frequencies(head_dim, base, scaling=None):
    """The `[head_dim/2]` angular frequencies (radians per position), float64; `scaling` a
    `RopeScaling` or None."""
    freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freq
    if scaling.kind == "linear":
        return freq / scaling.factor
    # "llama3": by wavelength, relative to the pre-training context length.
    wavelength = 2 * math.pi / freq
    context = scaling.original_max_seq_len
    long_wave = wavelength > context / scaling.low_freq_factor  # divided by the factor
    short_wave = wavelength < context / scaling.high_freq_factor  # kept
    # 0 at the long end of the blended band, 1 at its short end.
    smooth = ((context / wavelength - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * freq / scaling.factor + smooth * freq
    return torch.where(long_wave, freq / scaling.factor, torch.where(short_wave, freq, blended))


def rotary_tables(seq_len, head_dim, base, scaling=None):
    """cos and sin of every position's angles, `[seq_len, head_dim/2]` each, float32 (computed
    in float64)."""
    freq = rotary_frequencies(head_dim, base, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freq)  # [s, hd/2]
    return angles.cos().float(), angles.sin().float()


def rotate(x, cos, sin):
    """The rotation itself: cos and sin `[..., hd/2]` broadcast against x `[..., hd]` (a token
    at its own position, whatever the layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


__all__ = ["rotary_frequencies", "rotary_tables", "rotate"]
