"""DeepSeek-V3.2 with tensor_parallel_size=2 (gloo, two CPU processes): the greedy tokens and
logprobs of tensor_parallel_size=1, prompts past index_topk included (the sparse path); each rank
holds its share of the MLA heads and the whole indexer (replicated: both select the same tokens)."""
import torch

from tests.distributed.test_tensor_parallel import check_tp_matches_single
from tests.models.test_deepseek_v32 import make_tiny_v32


def test_deepseek_v32_tp2_matches_tp1(tmp_path):
    hf = make_tiny_v32(tmp_path, seed=1)
    ix = hf.config.index_n_heads * hf.config.index_head_dim
    per_head = hf.config.qk_nope_head_dim + hf.config.qk_rope_head_dim

    def check(model):
        attn = model.model.layers[1].self_attn
        assert attn.fused_q_b_proj.shard_sizes == [2 * per_head, ix]  # 2 of 4 heads, all of wq_b
        wq_b = hf.model.layers[1].self_attn.indexer.wq_b.weight
        torch.testing.assert_close(attn.fused_q_b_proj.weight[attn.fused_q_b_proj.shard_slice(1)], wq_b,
                                   atol=0, rtol=0)
        assert attn.indexer.weights_proj.weight.shape == hf.model.layers[1].self_attn.indexer.weights_proj.weight.shape

    check_tp_matches_single(tmp_path, n=16, check=check)
