"""The L2 prefetch helper's range split (``kernels/_common.l2_prefetch_chunk``, used by the MoE
launches; the kernel side runs in the GPU tests)."""
from blitzllm.kernels._common import L2_PREFETCH_LANES, l2_prefetch_chunk


def test_prefetch_chunk_covers_the_range_in_one_round():
    for nbytes, programs in [(33554432, 256), (8 << 20, 8), (100, 1000), (1, 1)]:
        c = l2_prefetch_chunk(nbytes, programs)
        assert c % 16 == 0 and c >= 256
        assert c * programs * L2_PREFETCH_LANES >= nbytes
        assert c == 256 or (c - 16) * programs * L2_PREFETCH_LANES < nbytes  # no larger than needed
