"""loader/gguf_file.py dequantizes the Q4_0 / Q4_1 / Q8_0 block formats itself, in one
vectorized pass: its values must be the gguf package's codec's, bit for bit, on every tensor of
the SmolLM2 GGUF and on blocks of each format quantized here from random data."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from blitzllm.loader.gguf_file import GRID_TYPES, _dequantize, open_gguf  # noqa: E402


def test_every_smollm2_tensor_equals_the_gguf_codec(smollm2_gguf):
    reader, _ = open_gguf(smollm2_gguf)
    kinds = set()
    for t in reader.tensors:
        ours = _dequantize(reader, t).reshape(-1)
        ref = gguf.quants.dequantize(reader.tensor_data(t), t.tensor_type).reshape(-1)
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ref.astype(np.float32), err_msg=t.name)
        kinds.add(int(t.tensor_type))
    assert {3, 8} <= kinds  # the file's Q4_1 linears and its Q8_0 embedding went through ours


class _Tensor:
    def __init__(self, ggml_type, rows, cols, data):
        self.tensor_type, self.shape, self.data = ggml_type, (cols, rows), data


class _Reader:
    def tensor_data(self, t):
        return t.data


@pytest.mark.parametrize("ggml_type", GRID_TYPES)
def test_each_block_format_equals_the_gguf_codec(ggml_type):
    x = np.random.default_rng(ggml_type).standard_normal((6, 96)).astype(np.float32) * 3
    blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType(ggml_type))
    t = _Tensor(ggml_type, 6, 96, blocks)
    ours = _dequantize(_Reader(), t).reshape(6, 96)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type))
    np.testing.assert_array_equal(ours, ref)
    # and it is the data: within half a 4-bit step of a block (Q4_1: its range / 30 <= max |x| / 15)
    assert np.abs(ours - x).max() <= np.abs(x).max() / 15
