"""Sliding windows over NCHW images: what convolution and pooling share.

A window op's output tile reads the input rows and columns its windows cover (its halo),
clipped to the input; padding is virtual, so a kernel works out from the tile and its input
rect how many padding rows and columns to add at each edge (`window_geometry`).
"""
from __future__ import annotations

from ops.base import Op, int_attr
from taskrt.geometry import Rect


def pair(kind: str, name: str, attr: str, value, least: int) -> tuple[int, ...]:
    """3 -> (3, 3); (2, 3) -> (2, 3), each an int >= least (ShapeError naming the op otherwise).
    A wrong length is left for infer_shapes to report."""
    if isinstance(value, (tuple, list)):
        return tuple(int_attr(kind, name, attr, v, least) for v in value)
    v = int_attr(kind, name, attr, value, least)
    return (v, v)


def check_window(op: Op, shape, kernel, stride, padding) -> tuple[int, int]:
    """Validate an NCHW input and window attributes; return the output (height, width)."""
    if len(shape) != 4:
        raise op.fail(f"expects an NCHW input (4 dims), got shape {tuple(shape)}")
    for label, val, least in (("kernel", kernel, 1), ("stride", stride, 1), ("padding", padding, 0)):
        if len(val) != 2 or min(val) < least:
            raise op.fail(f"{label} must be 2 ints >= {least}, got {val}")
    padded = (shape[2] + 2 * padding[0], shape[3] + 2 * padding[1])
    if kernel[0] > padded[0] or kernel[1] > padded[1]:
        raise op.fail(f"kernel {kernel} is bigger than the padded input {padded}")
    return tuple((p - k) // s + 1 for p, k, s in zip(padded, kernel, stride))


def span(lo: int, hi: int, stride: int, kernel: int, pad: int, size: int, n_out: int) -> tuple[int, int]:
    """Input range [a, b) that outputs [lo, hi) read along one dim, clipped to [0, size).

    A tile that ends at the last output also takes the trailing inputs no window reaches,
    so the tiles' rects cover the whole input (and its gradient is written everywhere).
    """
    start, stop = lo * stride - pad, (hi - 1) * stride - pad + kernel
    a = min(max(start, 0), size)
    return a, max(size if hi == n_out else min(stop, size), a)


def edge_pads(lo: int, hi: int, stride: int, kernel: int, pad: int, a: int, b: int) -> tuple[int, int]:
    """Padding (before, after) that extends the input range [a, b) to the windows of outputs [lo, hi).

    `after` is 0 when [a, b) reaches past the last window (see span)."""
    start, stop = lo * stride - pad, (hi - 1) * stride - pad + kernel
    if b > a:
        return a - start, max(stop - b, 0)
    return stop - start, 0


def window_geometry(tile: Rect, in_rect: Rect, kernel, stride, padding):
    """Padding of an input tile in H and W: ((top, bottom), (left, right))."""
    return tuple(edge_pads(tile.lo[d], tile.hi[d], stride[d - 2], kernel[d - 2], padding[d - 2],
                            in_rect.lo[d], in_rect.hi[d]) for d in (2, 3))


def pad(xp, x, pads, value=0.0):
    """x [N, C, H, W] with its virtual padding ((top, bottom), (left, right)) made real (x itself if none)."""
    if not any(pads[0]) and not any(pads[1]):
        return x
    return xp.pad(x, ((0, 0), (0, 0), pads[0], pads[1]), constant_values=value)


def strided(xpad, i: int, j: int, stride, out_hw):
    """The input under window offset (i, j) for every output position: [N, C, OH, OW]."""
    (sh, sw), (oh, ow) = stride, out_hw
    return xpad[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
