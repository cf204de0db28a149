import pytest
import torch

from quantizers.errors import QuantizerError
from quantizers.formats import awq_gemm, gptq
from quantizers.rtn import RTNConfig, quantize_rtn


def _weight(out=64, inp=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w[:, 3] *= 30  # an outlier input channel
    return w


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [False, True])
def test_gptq_pack_round_trip(bits, sym):
    iw = quantize_rtn(_weight(), RTNConfig(bits, 64, sym))
    packed = gptq.pack(iw)
    assert packed["qweight"].dtype == torch.int32 and packed["qweight"].shape == (256 * bits // 32, 64)
    assert packed["qzeros"].shape == (256 // 64, 64 * bits // 32)
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (4, 64)
    back = gptq.unpack(packed, bits, 64)
    assert torch.equal(back.q, iw.q) and torch.equal(back.zeros, iw.zeros)
    torch.testing.assert_close(back.dequantize(), iw.dequantize())


def test_gptq_3bit_values_straddle_words_like_autogptq():
    # 32 three-bit values make one 96-bit little-endian stream: value 10 has its low 2 bits at
    # the top of word 0 and its high bit at the bottom of word 1.
    q = torch.zeros(1, 32, dtype=torch.int32)
    q[0, 10] = 0b101
    from quantizers.formats.gptq import _pack_stream

    words = _pack_stream(q.t().contiguous(), 3)[:, 0].to(torch.int64) & 0xFFFFFFFF
    assert words[0].item() == 0b01 << 30 and words[1].item() == 0b1 and words[2].item() == 0


def test_awq_gemm_order_and_round_trip():
    iw = quantize_rtn(_weight(), RTNConfig(4, 128, False))
    packed = awq_gemm.pack(iw)
    assert packed["qweight"].shape == (256, 8) and packed["qzeros"].shape == (2, 8)
    back = awq_gemm.unpack(packed, 4, 128)
    assert torch.equal(back.q, iw.q) and torch.equal(back.zeros, iw.zeros)
    # AWQ_ORDER: output column 1 sits in nibble 4 of the first word
    word = packed["qweight"][0, 0].item() & 0xFFFFFFFF
    assert (word >> 16) & 0xF == iw.q[1, 0].item()
    with pytest.raises(QuantizerError, match="4-bit only"):
        awq_gemm.pack(quantize_rtn(_weight(), RTNConfig(3, 128, False)))


def test_rtn_error_falls_with_bits_and_bad_groups_are_named():
    w = _weight()
    errs = [(quantize_rtn(w, RTNConfig(b, 64)).dequantize() - w).norm().item() for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.05 * errs[0]
    with pytest.raises(QuantizerError, match=r"layer.x.weight: group_size=96 does not divide the input width 256"):
        quantize_rtn(w, RTNConfig(4, 96), name="layer.x.weight")


@pytest.mark.parametrize("fmt,bits,sym", [("awq", 4, False), ("gptq", 3, True), ("gptq", 2, False)])
def test_packing_and_dequantizing_stay_on_the_integers_device(fmt, bits, sym):
    """On a GPU, packing (quantize stage) and dequantizing (evaluate) run where the integers are; a
    tensor made on the host in between would fail on the 'meta' device, as it would be slow on a GPU."""
    from quantizers.formats import PackedWeight, pack
    from quantizers.rtn import RTNConfig, quantize_rtn

    cfg = RTNConfig(bits, 64, sym)
    pw = pack(quantize_rtn(torch.randn(128, 256), cfg), fmt)
    on_meta = PackedWeight(pw.format, {k: v.to("meta") for k, v in pw.parts.items()}, pw.bits, pw.group_size, pw.sym)
    assert on_meta.dequantize().device.type == "meta"
    with pytest.raises(NotImplementedError, match="meta"):  # only the final copy to the host is refused
        pack(quantize_rtn(torch.randn(128, 256, device="meta"), cfg), fmt)
