"""Our integer weights written as ggml blocks, read back by the gguf package's own dequantizer:
bit for bit for the exact mappings (issue 20)."""
import numpy as np
import pytest
import torch

from quantizers.errors import QuantizerError
from quantizers.formats import ggml
from quantizers.rtn import RTNConfig, quantize_rtn

gguf = pytest.importorskip("gguf")


def _weight(out=96, inp=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    w[:, [3, 77, 300]] *= 30  # outlier input columns, as trained weights have
    return w


def _gguf_dequant(blocks: np.ndarray, ggml_type: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[ggml_type]).copy())


@pytest.mark.parametrize("bits,sym,group,want", [
    (4, False, 128, "Q5_0"),  # AWQ's / rtn4's grid: asymmetric 4-bit needs the fifth bit
    (3, True, 128, "Q4_0"),  # auto-round's symmetric 3-bit
    (2, True, 64, "Q4_0"),
    (2, False, 128, "Q4_0"),  # asymmetric 2-bit: q - z stays in [-3, 3]
    (3, False, 32, "Q4_0"),
    (8, True, 128, "Q8_0"),
])
def test_exact_types_read_back_bit_identical(bits, sym, group, want):
    iw = quantize_rtn(_weight(), RTNConfig(bits, group, sym))
    assert ggml.exact_type(iw) == want
    for t in [want] + [t for t in ggml.EXACT_ORDER if t != want and ggml.fits(iw, t)]:
        blocks = ggml.pack(iw, t)
        assert blocks.dtype == np.uint8 and blocks.shape == (96, 512 // 32 * ggml.TYPE_BYTES[t])
        ours = iw.dequantize(torch.float32)
        theirs = _gguf_dequant(blocks, t)
        assert theirs.dtype == torch.float32 and torch.equal(theirs, ours), t


def test_q4_1_is_near_exact_and_says_so():
    iw = quantize_rtn(_weight(), RTNConfig(4, 128, False))
    assert not ggml.fits(iw, "Q4_1")  # the offset m is rounded to float16
    ours, theirs = iw.dequantize(torch.float32), _gguf_dequant(ggml.pack(iw, "Q4_1"), "Q4_1")
    err = (theirs - ours).abs().max() / ours.abs().max()
    assert 0 < err < 1e-3


def test_a_grid_a_type_cannot_hold_is_refused():
    iw = quantize_rtn(_weight(), RTNConfig(4, 128, False))  # q - z reaches beyond [-8, 7]
    assert not ggml.fits(iw, "Q4_0")
    with pytest.raises(QuantizerError, match="Q4_0 cannot hold this 4-bit grid exactly"):
        ggml.pack(iw, "Q4_0")
    iw8 = quantize_rtn(_weight(), RTNConfig(8, 128, False))
    assert ggml.exact_type(iw8) is None  # asymmetric 8-bit: q - z spans 511 values


def test_block_order_matters():
    """A swapped nibble order (value j + 16 in the low nibble) reads back wrong: the test can fail."""
    iw = quantize_rtn(_weight(), RTNConfig(3, 128, True))
    blocks = ggml.pack(iw, "Q4_0").reshape(-1, 18).copy()
    qs = blocks[:, 2:]
    blocks[:, 2:] = (qs >> 4) | ((qs & 0xF) << 4)
    assert not torch.equal(_gguf_dequant(blocks.reshape(96, -1), "Q4_0"), iw.dequantize(torch.float32))
