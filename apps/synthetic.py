"""Learnable synthetic data for the apps: labels that the inputs determine, reproducible for a seed.

Anything fixed across samples (class templates) comes from the model's seed alone, so a
sample drawn from its own generator (apps.cli.batch_source) is the same on any rank.
"""
from __future__ import annotations

import functools
import math

import numpy as np


@functools.lru_cache(maxsize=8)
def vector_templates(seed: int, classes: int, features: int) -> np.ndarray:
    """One random template per class, [classes, features], from the seed alone."""
    return np.random.default_rng([seed, 101]).standard_normal((classes, features)).astype(np.float32)


def vectors(rng, seed: int, batch_size: int, classes: int, features: int):
    """(x [batch, features], labels): class c's template plus unit noise."""
    labels = rng.integers(0, classes, batch_size)
    x = vector_templates(seed, classes, features)[labels]
    return x + rng.standard_normal(x.shape, dtype=np.float32), labels


@functools.lru_cache(maxsize=8)
def image_templates(seed: int, classes: int, channels: int, grid: int) -> np.ndarray:
    """One coarse random pattern per class, [classes, channels, grid, grid], from the seed alone."""
    return np.random.default_rng([seed, 202]).standard_normal((classes, channels, grid, grid)).astype(np.float32)


def images(rng, seed: int, batch_size: int, classes: int, shape, grid: int = 4, amplitude: float = 2.0):
    """(images [batch, C, H, W], labels): class c's coarse pattern (std `amplitude`) stretched over
    the image, plus unit-variance noise: uniform, which numpy draws 3.5 times as fast as normal
    (normals were two thirds of a tiny alexnet's batch)."""
    c, h, w = shape
    labels = rng.integers(0, classes, batch_size)
    coarse = image_templates(seed, classes, c, grid)[labels]
    rows = np.arange(h) * grid // h
    cols = np.arange(w) * grid // w
    x = amplitude * coarse.take(rows, axis=2).take(cols, axis=3)   # C-contiguous, unlike a 2-D fancy index
    noise = rng.random(x.shape, dtype=np.float32)
    noise -= 0.5
    noise *= np.float32(math.sqrt(12.0))
    x += noise
    return x, labels


def marked_tokens(rng, batch_size: int, seq_len: int, vocab: int, classes: int, first_filler: int):
    """(tokens [batch, seq], labels): filler tokens from [first_filler, vocab) with one marker token
    (id 2 + class) at a random position after the first; the label is the marker's class."""
    labels = rng.integers(0, classes, batch_size)
    tokens = rng.integers(first_filler, vocab, (batch_size, seq_len))
    where = rng.integers(1, seq_len, batch_size)
    tokens[np.arange(batch_size), where] = 2 + labels
    return tokens, labels
