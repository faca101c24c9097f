"""YUV 4:2:0 -> RGB: bit-exact with OpenCV on the default path, within 1 on the float path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyperacc.data.yuv import YUVToRGB, q20_constants, yuv_to_rgb

cv2 = pytest.importorskip("cv2", reason="the data extra is not installed (pip install -e '.[data]')")

CODES = {
    "nv12": cv2.COLOR_YUV2RGB_NV12,
    "nv21": cv2.COLOR_YUV2RGB_NV21,
    "i420": cv2.COLOR_YUV2RGB_I420,
    "yv12": cv2.COLOR_YUV2RGB_YV12,
}
# odd sizes: chroma widths/heights that are odd (W/2 = 1, 5, 9, 33), heights not multiples of 4
SIZES = [(2, 2), (6, 10), (34, 18), (122, 66), (2, 130)]


def _frames(batch: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, h * 3 // 2, w), dtype=np.uint8)


def _opencv(frames: np.ndarray, layout: str) -> np.ndarray:
    return np.stack([cv2.cvtColor(f, CODES[layout]) for f in frames]).transpose(0, 3, 1, 2)


def test_default_constants_are_opencvs():
    assert q20_constants() == {"cy": 1220542, "cvr": 1673527, "cvg": -852492, "cug": -409993, "cub": 2116026}


@pytest.mark.parametrize("layout", list(CODES))
@pytest.mark.parametrize("h,w", SIZES)
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_integer_path_is_bit_exact_with_opencv(layout, h, w, backend):
    """The tensor path (what runs on a device) and the CPU default (OpenCV itself) agree bit for bit."""
    frames = _frames(3, h, w, seed=h * w)
    ours = yuv_to_rgb(torch.from_numpy(frames), layout, backend=backend).numpy()
    np.testing.assert_array_equal(ours, _opencv(frames, layout))


@pytest.mark.parametrize(
    "options",
    [{}, {"size": (20, 30)}, {"dtype": torch.float32}, {"size": (16, 16), "dtype": torch.float16},
     {"size": (20, 30), "dtype": torch.float32, "mean": (0.4, 0.5, 0.6), "std": (0.2, 0.25, 0.3)}],
)  # fmt: skip
def test_cpu_default_equals_the_tensor_path_for_every_output(options):
    frames = torch.from_numpy(_frames(2, 34, 62, seed=5))
    for layout in CODES:
        a = yuv_to_rgb(frames, layout, **options)
        b = yuv_to_rgb(frames, layout, backend="torch", **options)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


def test_backend_choice_is_checked():
    frames = torch.from_numpy(_frames(1, 8, 8))
    with pytest.raises(ValueError, match="backend='gpu' is not one of"):
        yuv_to_rgb(frames, backend="gpu")
    with pytest.raises(ValueError, match="BT.601 limited-range"):
        yuv_to_rgb(frames, matrix="bt709", backend="opencv")
    # other matrices take the tensor path under "auto"
    assert torch.equal(yuv_to_rgb(frames, matrix="bt709"), yuv_to_rgb(frames, matrix="bt709", backend="torch"))


@pytest.mark.parametrize("layout", list(CODES))
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_float_path_is_within_one_of_opencv(layout, backend):
    frames = _frames(2, 48, 66, seed=3)
    ours = yuv_to_rgb(torch.from_numpy(frames), layout, exact=False, backend=backend).numpy().astype(int)
    assert np.abs(ours - _opencv(frames, layout)).max() <= 1


def test_single_frame_and_extra_batch_dims_keep_their_shape():
    frames = torch.from_numpy(_frames(6, 8, 12)).view(2, 3, 12, 12)
    out = yuv_to_rgb(frames)
    assert out.shape == (2, 3, 3, 8, 12)
    assert torch.equal(yuv_to_rgb(frames[1, 2]), out[1, 2])


def _reference(frames: np.ndarray, matrix: str, full_range: bool) -> np.ndarray:
    """Float64 textbook conversion from Kr/Kb, for the matrices OpenCV's NV12 path does not offer."""
    kr, kb = {"bt601": (0.299, 0.114), "bt709": (0.2126, 0.0722)}[matrix]
    kg = 1 - kr - kb
    b, rows, w = frames.shape
    h = rows * 2 // 3
    y = frames[:, :h].astype(np.float64)
    uv = frames[:, h:].reshape(b, h // 2, w // 2, 2).astype(np.float64)
    u = uv[..., 0].repeat(2, 1).repeat(2, 2) - 128
    v = uv[..., 1].repeat(2, 1).repeat(2, 2) - 128
    if full_range:
        yy, cc = y, 1.0
    else:
        yy, cc = np.maximum(y - 16, 0) * 255 / 219, 255 / 224
    r = yy + 2 * (1 - kr) * cc * v
    g = yy - 2 * kb * (1 - kb) / kg * cc * u - 2 * kr * (1 - kr) / kg * cc * v
    bl = yy + 2 * (1 - kb) * cc * u
    return np.clip(np.rint(np.stack([r, g, bl], 1)), 0, 255)


# BT.601 limited is checked bit-exactly against OpenCV above (its rounded coefficients are not textbook).
@pytest.mark.parametrize("matrix,full_range", [("bt601", True), ("bt709", False), ("bt709", True)])
@pytest.mark.parametrize("exact", [True, False])
def test_other_matrices_and_ranges_match_the_textbook_formula(matrix, full_range, exact):
    frames = _frames(2, 20, 30, seed=7)
    ours = yuv_to_rgb(torch.from_numpy(frames), matrix=matrix, full_range=full_range, exact=exact).numpy()
    assert np.abs(ours.astype(int) - _reference(frames, matrix, full_range)).max() <= 1


def test_grey_chroma_gives_grey_and_full_range_is_identity_on_luma():
    h, w = 4, 6
    frames = np.full((1, h * 3 // 2, w), 128, np.uint8)
    frames[0, :h] = np.arange(h * w).reshape(h, w) * 10 % 256
    out = yuv_to_rgb(torch.from_numpy(frames), full_range=True).numpy()
    assert (
        (out[0, 0] == frames[0, :h]).all()
        and (out[0, 1] == out[0, 0]).all()
        and (out[0, 2] == out[0, 0]).all()
    )


@pytest.mark.parametrize("exact", [True, False])
def test_resize_is_antialiased_and_close_to_opencv_area_resize(exact):
    # a smooth image, so resampling filters agree closely
    h, w = 96, 128
    yy, xx = np.mgrid[0:h, 0:w]
    frames = np.empty((1, h * 3 // 2, w), np.uint8)
    frames[0, :h] = (40 + 150 * (xx / w) * (yy / h)).astype(np.uint8)
    frames[0, h:] = (100 + 60 * np.mgrid[0 : h // 2, 0:w][1] / w).astype(np.uint8)
    ours = yuv_to_rgb(torch.from_numpy(frames), size=(24, 32), exact=exact).numpy()[0].transpose(1, 2, 0)
    ref = cv2.resize(cv2.cvtColor(frames[0], cv2.COLOR_YUV2RGB_NV12), (32, 24), interpolation=cv2.INTER_AREA)
    assert ours.shape == (24, 32, 3)
    assert np.abs(ours.astype(int) - ref).mean() < 1.0
    assert np.abs(ours.astype(int) - ref).max() <= 4


def test_float_output_range_and_normalisation():
    frames = torch.from_numpy(_frames(2, 16, 16))
    u8 = yuv_to_rgb(frames)
    f = yuv_to_rgb(frames, dtype=torch.float32)
    assert f.dtype == torch.float32 and 0 <= f.min() and f.max() <= 1
    torch.testing.assert_close(f * 255, u8.float())
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    n = yuv_to_rgb(frames, dtype=torch.float32, mean=mean, std=std)
    expect = (f - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    torch.testing.assert_close(n, expect)
    h = yuv_to_rgb(frames, dtype=torch.float16, size=(8, 8))
    assert h.dtype == torch.float16 and h.shape == (2, 3, 8, 8)


def test_workspace_reuse_does_not_leak_between_calls():
    conv = YUVToRGB(field=None)
    a, b = torch.from_numpy(_frames(2, 8, 8, seed=1)), torch.from_numpy(_frames(2, 8, 8, seed=2))
    out_a = conv(a)
    out_b = conv(b)
    assert torch.equal(out_a, yuv_to_rgb(a)) and torch.equal(out_b, yuv_to_rgb(b))
    assert torch.equal(
        conv(torch.from_numpy(_frames(1, 4, 6))), yuv_to_rgb(torch.from_numpy(_frames(1, 4, 6)))
    )


def test_transform_picks_its_field_in_structured_batches():
    frames = torch.from_numpy(_frames(2, 4, 4))
    labels = torch.tensor([1, 2])
    x, y = YUVToRGB()((frames, labels))
    assert x.shape == (2, 3, 4, 4) and y is labels
    d = YUVToRGB("i420", field="img")({"img": frames, "y": labels})
    assert torch.equal(d["img"], yuv_to_rgb(frames, "i420")) and d["y"] is labels


def test_bad_input_gives_clear_errors():
    with pytest.raises(ValueError, match="even H and W"):
        yuv_to_rgb(torch.zeros(1, 9, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even H and W"):
        yuv_to_rgb(torch.zeros(1, 10, 6, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        yuv_to_rgb(torch.zeros(1, 6, 4))
    with pytest.raises(ValueError, match="layout"):
        yuv_to_rgb(torch.zeros(1, 6, 4, dtype=torch.uint8), "nv16")
    with pytest.raises(ValueError, match="float dtype"):
        yuv_to_rgb(torch.zeros(1, 6, 4, dtype=torch.uint8), mean=(0, 0, 0), std=(1, 1, 1))
    with pytest.raises(ValueError, match="matrix"):
        yuv_to_rgb(torch.zeros(1, 6, 4, dtype=torch.uint8), matrix="bt2020")
