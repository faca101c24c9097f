"""YUV 4:2:0 to RGB (and resize) as tensor operations, on whatever device the frames are on.

Why: per-pixel colour conversion on the CPU holds a core per frame stream (and the GIL when done in
Python), and an RGB frame is twice the bytes of its YUV 4:2:0 source. Keeping the raw YUV until it is
on the device halves what crosses PCIe (1.5 bytes per pixel instead of 3) and moves the per-pixel work
onto the device stream: pass :class:`YUVToRGB` as the ``transform`` of
:class:`~hyperacc.data.prefetch.DevicePrefetcher`.

Input: ``uint8`` tensors shaped like OpenCV's YUV 4:2:0 images, ``(..., H * 3 // 2, W)`` (a single
frame or any batch shape), with even ``H`` and ``W``; layouts ``nv12`` (Y plane, then interleaved U,V),
``nv21`` (V,U), ``i420`` (Y, U plane, V plane) and ``yv12`` (Y, V, U). Output ``(..., 3, H', W')``.

Backends: on a CPU the bit-exact BT.601 limited-range conversion is OpenCV's own ``cvtColor`` when
OpenCV is installed (``backend="auto"``, the default): its hand-vectorised kernel is many times faster
than generic tensor operations on a CPU, and it is the result the tensor path reproduces bit for bit.
The tensor path is for the device (and for the CPU when OpenCV is missing, or ``backend="torch"``).
``exact=False`` on a CPU also takes OpenCV's result, which is within the float path's tolerance.

Two arithmetic paths of the tensor backend:

* ``exact=True`` (default): Q20 fixed-point integers. For BT.601 limited range (the default) these are
  OpenCV's own constants (``cv2.COLOR_YUV2RGB_NV12/NV21/I420/YV12``), so the result is bit-exact with
  OpenCV: ``y = max(0, Y-16) * CY``, ``R = sat((y + CVR*(V-128) + 2^19) >> 20)``, and so on. Other
  matrices and full range use constants derived from the standard's Kr/Kb the same way.
* ``exact=False``: float32 with the same coefficients, rounded at the end (within 1 of OpenCV).

Resize (``size=(h, w)``) runs after the conversion, in the same call, in float32 with torch's
antialiased bilinear filter; output ``uint8`` (rounded) or ``float32`` in [0, 1], optionally
normalised with ``mean``/``std``. Rules and constants: docs/data.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "LAYOUTS", "MATRICES", "YUVToRGB", "opencv_available", "q20_constants", "yuv_to_rgb"]

LAYOUTS = ("nv12", "nv21", "i420", "yv12")
BACKENDS = ("auto", "opencv", "torch")
MATRICES = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722)}  # (Kr, Kb)

# OpenCV's BT.601 limited-range constants (modules/imgproc colour_yuv): 3-decimal coefficients in Q20.
_OPENCV_601_LIMITED = {
    "cy": 1220542,  # 1.164
    "cvr": 1673527,  # 1.596
    "cvg": -852492,  # -0.813
    "cug": -409993,  # -0.391
    "cub": 2116026,  # 2.018
}
_SHIFT = 20


def _coefficients(matrix: str, full_range: bool) -> dict[str, float]:
    """Float coefficients: R = cy*y + cvr*v, G = cy*y + cvg*v + cug*u, B = cy*y + cub*u (u, v centred)."""
    if matrix not in MATRICES:
        raise ValueError(f"matrix={matrix!r} is not one of {sorted(MATRICES)}")
    if matrix == "bt601" and not full_range:
        return {k: v / (1 << _SHIFT) for k, v in _OPENCV_601_LIMITED.items()}
    kr, kb = MATRICES[matrix]
    kg = 1.0 - kr - kb
    cy, cc = (1.0, 1.0) if full_range else (255.0 / 219.0, 255.0 / 224.0)
    return {
        "cy": cy,
        "cvr": 2.0 * (1.0 - kr) * cc,
        "cvg": -2.0 * kr * (1.0 - kr) / kg * cc,
        "cug": -2.0 * kb * (1.0 - kb) / kg * cc,
        "cub": 2.0 * (1.0 - kb) * cc,
    }


def q20_constants(matrix: str = "bt601", full_range: bool = False) -> dict[str, int]:
    """The Q20 fixed-point constants the exact path uses (OpenCV's own for BT.601 limited)."""
    if matrix == "bt601" and not full_range:
        return dict(_OPENCV_601_LIMITED)
    return {k: round(v * (1 << _SHIFT)) for k, v in _coefficients(matrix, full_range).items()}


def _planes(frames: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Split ``(B, 3H/2, W)`` uint8 into Y ``(B,H,W)``, U and V ``(B,H/2,W/2)`` views."""
    rows, width = frames.shape[-2], frames.shape[-1]
    if rows % 3 or width % 2 or (rows * 2 // 3) % 2:
        raise ValueError(
            f"YUV 4:2:0 frames must be shaped (..., H*3/2, W) with even H and W; got rows={rows}, width={width}"
        )
    h = rows * 2 // 3
    b = frames.shape[0]
    y = frames[:, :h, :]
    chroma = frames[:, h:, :].reshape(b, -1)
    h2, w2 = h // 2, width // 2
    if layout in ("nv12", "nv21"):
        uv = chroma.view(b, h2, w2, 2)
        first, second = uv[..., 0], uv[..., 1]
        u, v = (first, second) if layout == "nv12" else (second, first)
    else:
        q = h2 * w2
        first, second = chroma[:, :q].view(b, h2, w2), chroma[:, q:].view(b, h2, w2)
        u, v = (first, second) if layout == "i420" else (second, first)
    return y, u, v, h, width


def _scratch(
    ws: dict, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A temporary kept in ``ws`` between calls (fresh large CPU allocations fault every page in again)."""
    key = (name, shape, dtype, device)
    buf = ws.get(key)
    if buf is None:
        for old in [k for k in ws if k[0] == name]:
            del ws[old]  # one buffer per name: a new frame size replaces the old one
        buf = ws[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def _convert(
    y8, u8, v8, h, w, exact: bool, coef: dict, full_range: bool, out: torch.Tensor, ws: dict
) -> None:
    """Write RGB into ``out`` (B,3,H,W): uint8 when ``exact`` (Q20 integers, rounded and saturated as
    OpenCV does), else float32 in 0..255 (unrounded, unclamped)."""
    b = y8.shape[0]
    h2, w2 = h // 2, w // 2
    device = y8.device
    work = torch.int32 if exact else torch.float32
    y = _scratch(ws, "y", (b, h, w), work, device)
    y.copy_(y8)
    if not full_range:
        y.sub_(16).clamp_(min=0)
    y.mul_(coef["cy"])
    y4 = y.view(b, h2, 2, w)
    u = _scratch(ws, "u", (b, h2, w2), work, device)
    v = _scratch(ws, "v", (b, h2, w2), work, device)
    u.copy_(u8).sub_(128)
    v.copy_(v8).sub_(128)
    term = _scratch(ws, "term", (b, h2, w2), work, device)
    rows = _scratch(ws, "rows", (b, h2, w), work, device)
    tmp = _scratch(ws, "tmp", (b, h, w), work, device) if exact else None
    half = 1 << (_SHIFT - 1) if exact else 0
    planes = out.view(b, 3, h2, 2, w)
    for c in range(3):
        if c == 0:
            torch.mul(v, coef["cvr"], out=term)
        elif c == 1:
            torch.mul(v, coef["cvg"], out=term).add_(u, alpha=coef["cug"])
        else:
            torch.mul(u, coef["cub"], out=term)
        if half:
            term.add_(half)
        # Chroma is replicated over each 2x2 block, as OpenCV does. Doubling the width once keeps the
        # innermost dimension long and contiguous so the full-size addition vectorises; the row
        # doubling is a free broadcast.
        pairs = rows.view(b, h2, w2, 2)
        pairs[..., 0] = term
        pairs[..., 1] = term
        if exact:
            torch.add(y4, rows.view(b, h2, 1, w), out=tmp.view(b, h2, 2, w))
            planes[:, c].copy_(tmp.bitwise_right_shift_(_SHIFT).clamp_(0, 255).view(b, h2, 2, w))
        else:
            torch.add(y4, rows.view(b, h2, 1, w), out=planes[:, c])


_CV2: Any = None  # the cv2 module once imported; False when it is not installed


def opencv_available() -> bool:
    """Is OpenCV importable (``pip install 'hyperacc[data]'``)?"""
    global _CV2
    if _CV2 is None:
        try:
            import cv2

            _CV2 = cv2
        except ImportError:
            _CV2 = False
    return _CV2 is not False


def _opencv_codes() -> dict[str, int]:
    cv2 = _CV2
    return {"nv12": cv2.COLOR_YUV2RGB_NV12, "nv21": cv2.COLOR_YUV2RGB_NV21,
            "i420": cv2.COLOR_YUV2RGB_I420, "yv12": cv2.COLOR_YUV2RGB_YV12}  # fmt: skip


def _convert_opencv(flat: torch.Tensor, layout: str, h: int, w: int) -> torch.Tensor:
    """OpenCV's conversion of each frame into one ``(B, H, W, 3)`` buffer, returned as a ``(B, 3, H, W)``
    view (channels-last strides: the values of the tensor path, without a transposing copy)."""
    code = _opencv_codes()[layout]
    src = flat.contiguous().numpy()
    hwc = torch.empty((flat.shape[0], h, w, 3), dtype=torch.uint8)
    dst = hwc.numpy()
    for i in range(src.shape[0]):
        _CV2.cvtColor(src[i], code, dst=dst[i])
    return hwc.permute(0, 3, 1, 2)


def _use_opencv(backend: str, device: torch.device, exact: bool, matrix: str, full_range: bool) -> bool:
    """OpenCV converts on the CPU when it computes exactly what was asked (BT.601 limited, exact)."""
    if backend == "torch" or device.type != "cpu":
        if backend == "opencv" and device.type != "cpu":
            raise ValueError(f"backend='opencv' converts CPU tensors only; the frames are on {device}")
        return False
    # exact=False asks for the float path's accuracy (within 1 of OpenCV): OpenCV itself meets it.
    fits = matrix == "bt601" and not full_range
    if backend == "opencv":
        if not opencv_available():
            raise ValueError("backend='opencv' needs OpenCV: pip install 'hyperacc[data]' (or backend='auto')")
        if not fits:
            raise ValueError(
                "backend='opencv' does only OpenCV's BT.601 limited-range conversion (matrix='bt601', "
                "full_range=False); use backend='auto' or 'torch' for the others"
            )
        return True
    return fits and opencv_available()


def _convert_frames(y8, u8, v8, h, w, exact, coef, full_range, out, ws) -> None:
    if out.device.type != "cpu":
        _convert(y8, u8, v8, h, w, exact, coef, full_range, out, ws)
        return
    # On a CPU, one frame at a time keeps the temporaries in cache (about 2x faster for batches).
    for i in range(out.shape[0]):
        j = slice(i, i + 1)
        _convert(y8[j], u8[j], v8[j], h, w, exact, coef, full_range, out[j], ws)


def yuv_to_rgb(
    frames: torch.Tensor,
    layout: str = "nv12",
    *,
    matrix: str = "bt601",
    full_range: bool = False,
    exact: bool = True,
    size: tuple[int, int] | None = None,
    antialias: bool = True,
    dtype: torch.dtype = torch.uint8,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    workspace: dict | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Convert YUV 4:2:0 frames ``(..., H*3/2, W)`` uint8 to RGB ``(..., 3, H', W')`` on their device.

    ``layout``: nv12 | nv21 | i420 | yv12. ``matrix``: bt601 | bt709; ``full_range`` False means
    limited (studio) range. ``exact``: integer Q20 path (bit-exact with OpenCV for BT.601 limited)
    or float path. ``size``: ``(h, w)`` to resize to after the conversion (antialiased bilinear when
    ``antialias``). ``dtype``: ``torch.uint8`` (0..255) or a float dtype (0..1, then ``(x-mean)/std``
    per channel when ``mean``/``std`` are given). ``workspace``: a dict in which temporaries are kept
    between calls (what :class:`YUVToRGB` does); the returned tensor is always freshly allocated.
    ``backend``: ``"auto"`` (OpenCV for CPU frames when it computes exactly this conversion and is
    installed, else tensor operations), ``"opencv"`` (or a ``ValueError``) or ``"torch"``. The OpenCV
    path returns channels-last strides (same shape and values; ``.contiguous()`` for NCHW strides).
    """
    if not isinstance(frames, torch.Tensor) or frames.dtype != torch.uint8:
        raise TypeError(
            f"frames must be a uint8 tensor, got {type(frames).__name__} {getattr(frames, 'dtype', '')}"
        )
    if frames.dim() < 2:
        raise ValueError(f"frames must be (..., H*3/2, W), got shape {tuple(frames.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    floating = dtype.is_floating_point
    if not floating and dtype != torch.uint8:
        raise ValueError(f"dtype must be torch.uint8 or a float dtype, got {dtype}")
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    if mean is not None and not floating:
        raise ValueError("normalisation (mean/std) needs a float dtype, e.g. dtype=torch.float32")
    if size is not None and (len(size) != 2 or min(size) < 1):
        raise ValueError(f"size must be (height, width) with positive entries, got {size!r}")

    ws = {} if workspace is None else workspace
    lead = frames.shape[:-2]
    flat = frames.reshape(-1, frames.shape[-2], frames.shape[-1])
    y8, u8, v8, h, w = _planes(flat, layout)
    b = flat.shape[0]
    device = frames.device
    resize = size is not None and tuple(size) != (h, w)
    coef = q20_constants(matrix, full_range) if exact else _coefficients(matrix, full_range)

    opencv = _use_opencv(backend, device, exact, matrix, full_range)
    if exact or opencv:
        if opencv:
            rgb8 = _convert_opencv(flat, layout, h, w)
            if not resize and not floating:
                return rgb8.reshape(*lead, 3, h, w)
        elif not resize and not floating:
            rgb8 = torch.empty((b, 3, h, w), dtype=torch.uint8, device=device)
            _convert_frames(y8, u8, v8, h, w, True, coef, full_range, rgb8, ws)
            return rgb8.reshape(*lead, 3, h, w)
        else:
            rgb8 = _scratch(ws, "rgb8", (b, 3, h, w), torch.uint8, device)
            _convert_frames(y8, u8, v8, h, w, True, coef, full_range, rgb8, ws)
        if resize and device.type == "cpu":
            # torch's CPU antialiased resize is fastest on uint8 channels-last (a SIMD path).
            src = rgb8.contiguous(memory_format=torch.channels_last)
            rgb = F.interpolate(
                src, size=tuple(size), mode="bilinear", align_corners=False, antialias=antialias
            )
            rgb = rgb.contiguous()
            if not floating:
                return rgb.reshape(*lead, 3, rgb.shape[-2], rgb.shape[-1])
            rgb = rgb.to(torch.float32)
            resize = False
        else:
            rgb = rgb8.to(torch.float32)
    else:
        returned = floating and not resize and dtype == torch.float32
        shape = (b, 3, h, w)
        rgb = (
            torch.empty(shape, dtype=torch.float32, device=device)
            if returned
            else _scratch(ws, "rgbf", shape, torch.float32, device)
        )
        _convert_frames(y8, u8, v8, h, w, False, coef, full_range, rgb, ws)
        rgb.clamp_(0.0, 255.0)

    if resize:
        rgb = F.interpolate(rgb, size=tuple(size), mode="bilinear", align_corners=False, antialias=antialias)
    out_h, out_w = rgb.shape[-2], rgb.shape[-1]
    if not floating:
        return rgb.round_().clamp_(0, 255).to(torch.uint8).reshape(*lead, 3, out_h, out_w)
    rgb = rgb.clamp_(0.0, 255.0).mul_(1.0 / 255.0)
    if mean is not None:
        m = torch.as_tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        s = torch.as_tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        rgb = rgb.sub_(m).div_(s)
    return rgb.to(dtype).reshape(*lead, 3, out_h, out_w)


class YUVToRGB:
    """:func:`yuv_to_rgb` with fixed options, usable as a ``DevicePrefetcher(transform=...)``.

    ``field`` picks what to convert in a structured batch: an int for tuples/lists, a key for dicts;
    ``None`` means the batch is the frames tensor itself. Everything else passes through unchanged.
    """

    def __init__(self, layout: str = "nv12", *, field: int | str | None = 0, **options: Any) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
        self.layout = layout
        self.field = field
        self.options = options
        self.workspace: dict = {}  # temporaries reused between batches

    def convert(self, frames: torch.Tensor) -> torch.Tensor:
        return yuv_to_rgb(frames, self.layout, workspace=self.workspace, **self.options)

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor) or self.field is None:
            return self.convert(batch)
        if isinstance(batch, Mapping):
            out = dict(batch)
            out[self.field] = self.convert(batch[self.field])
            return out
        if isinstance(batch, tuple | list):
            items = list(batch)
            items[self.field] = self.convert(items[self.field])  # type: ignore[index]
            return type(batch)(items) if not hasattr(batch, "_fields") else type(batch)(*items)
        raise TypeError(f"YUVToRGB cannot find field {self.field!r} in a {type(batch).__name__}")
