"""FP8 E4M3 per-output-channel weights in compressed-tensors layout."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from quantizers.errors import QuantizerError
from quantizers.formats.fp8_channel import FP8_DTYPE, quantization_config
from quantizers.formats.fp8_channel import dequantize as dequantize_fp8
from quantizers.fp8 import FP8_MAX, SCALE_EPS, quantize_fp8


def heavy_tailed(rows=48, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) / torch.randn(rows, cols, generator=g).abs().clamp(min=0.05) * 0.01
    w[3] *= 1000.0  # one very loud row: per-channel scales must keep the others precise
    return w


def test_layout_and_scale_rule():
    w = heavy_tailed()
    q = quantize_fp8(w)
    assert q.weight.dtype == FP8_DTYPE and q.weight.shape == w.shape
    assert q.weight_scale.dtype == torch.float32 and q.weight_scale.shape == (48, 1)
    torch.testing.assert_close(q.weight_scale, w.abs().amax(1, keepdim=True) / 448)
    # Each row's largest magnitude lands exactly on the top of the E4M3 grid.
    assert torch.equal(q.weight.float().abs().amax(1), torch.full((48,), FP8_MAX))


def test_round_trip_error_is_within_e4m3_rounding():
    w = heavy_tailed()
    q = quantize_fp8(w)
    x = w / q.weight_scale  # the value the cast rounded
    err = (q.weight.float() - x).abs()
    # 3 mantissa bits: half an ulp is 2^-4 of the value's binade for normals (|x| >= 2^-6),
    # and half the smallest subnormal step (2^-9) below that.
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10))
    assert (err <= bound * (1 + 1e-6)).all()
    deq = q.dequantize(torch.float32)
    rel = (deq - w).norm(dim=1) / w.norm(dim=1)
    assert rel.max() < 0.05


def test_per_channel_scales_survive_row_spreads_a_single_scale_cannot():
    w = heavy_tailed()
    w[3] *= 1e5  # beyond E4M3's ~2^18 dynamic range relative to the quiet rows
    rel = lambda d: ((d - w).norm(dim=1) / w.norm(dim=1)).max()  # noqa: E731
    assert rel(quantize_fp8(w).dequantize(torch.float32)) < 0.05
    s = w.abs().max() / 448
    assert rel((w / s).to(FP8_DTYPE).float() * s) > 0.5  # one per-tensor scale flushes the quiet rows


def test_zero_rows_get_eps_scale_and_dequantize_to_zero():
    w = heavy_tailed()
    w[7] = 0
    q = quantize_fp8(w)
    assert q.weight_scale[7, 0] == SCALE_EPS
    assert torch.equal(q.dequantize(torch.bfloat16)[7], torch.zeros(64, dtype=torch.bfloat16))


def test_dequantize_dtype_and_formula():
    w = heavy_tailed()
    q = quantize_fp8(w)
    out = dequantize_fp8(q.weight, q.weight_scale, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (q.weight.float() * q.weight_scale).to(torch.bfloat16))


def test_safetensors_round_trip_keeps_bits(tmp_path):
    q = quantize_fp8(heavy_tailed())
    save_file({"x.weight": q.weight, "x.weight_scale": q.weight_scale}, str(tmp_path / "m.safetensors"))
    back = load_file(tmp_path / "m.safetensors")
    assert back["x.weight"].dtype == FP8_DTYPE
    assert torch.equal(back["x.weight"].view(torch.uint8), q.weight.view(torch.uint8))
    assert torch.equal(back["x.weight_scale"], q.weight_scale)


def test_bad_input_is_named():
    with pytest.raises(QuantizerError, match="dec.w: expected a non-empty 2-D"):
        quantize_fp8(torch.zeros(2, 3, 4), name="dec.w")
    w = heavy_tailed()
    w[0, 0] = float("nan")
    with pytest.raises(QuantizerError, match="dec.w: weight contains NaN"):
        quantize_fp8(w, name="dec.w")
    q = quantize_fp8(heavy_tailed())
    with pytest.raises(QuantizerError, match=r"dec.w_scale: shape \[48\], expected \[48, 1\]"):
        dequantize_fp8(q.weight, q.weight_scale[:, 0], name="dec.w")
    with pytest.raises(QuantizerError, match="expected torch.float8_e4m3fn"):
        dequantize_fp8(q.weight.float(), q.weight_scale)


def test_quantization_config_is_compressed_tensors_fp8_channel():
    qc = quantization_config(ignore=["decoder.4.output_proj", "decoder.0.input_proj"])
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"]) == (8, "float", True, "channel")
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert qc["ignore"] == ["decoder.0.input_proj", "decoder.4.output_proj"]
