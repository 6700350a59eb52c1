"""MTP speculative decoding (``method: "mtp"``) on a tiny DeepSeek-V3 checkpoint with a
multi-token-prediction layer: greedy output equals non-speculative greedy output token for
token (batches, chunked prefill, several k); every draft the engine proposed equals the draft
an independent reference computes from transformers' DeepSeek-V3 decoder layer loaded with
the MTP weights; dummy weights; errors. (Sampled output keeps the target distribution through
the same rejection sampler as every point-draft proposer: tests/engine/test_spec_distribution.py.)"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from blitzllm import LLM, SamplingParams
from blitzllm.spec import mtp as mtp_mod
from tests.models.test_deepseek_v3 import _add_mtp_weights, make_tiny_deepseek

KW = dict(device="cpu", dtype="float32", kv_cache_blocks=96)


class FactoryDtypes(TorchFunctionMode):
    """The dtypes of every tensor torch.empty / zeros / ones return inside the block."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.empty, torch.zeros, torch.ones) and isinstance(out, torch.Tensor):
            self.dtypes.add(out.dtype)
        return out


@pytest.fixture(scope="module")
def ds_mtp(tmp_path_factory):
    """(folder, transformers model with the MTP layer as its last decoder layer, MTP extras)."""
    path = tmp_path_factory.mktemp("ds-mtp")
    hf = make_tiny_deepseek(path, seed=4, num_hidden_layers=2)
    extra = _add_mtp_weights(path, hf)
    return path, hf, extra


def _prompts(seed=3, lengths=(1, 7, 19, 33)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(ds_mtp, k):
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    prompts = _prompts()
    want = [o.token_ids for o in LLM(str(ds_mtp[0]), **KW).generate(prompts, params)]
    llm = LLM(str(ds_mtp[0]), **KW, max_num_batched_tokens=24,  # chunked prefill too
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    st = llm.stats()
    assert st["spec_method"] == "mtp" and st["spec_draft_tokens"] > 0
    assert st["kv_blocks_free"] == 96
    # sampled requests take the same drafts through the rejection sampler
    outs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, ignore_eos=True, seed=1))
    assert [len(o.token_ids) for o in outs] == [14] * len(prompts)
    assert llm.stats()["kv_blocks_free"] == 96


def _reference_drafts(hf, extra, ids: list, k: int, arch: str = "DeepseekV3") -> list:
    """k greedy MTP drafts after token list ``ids``, from transformers: the main model's final
    hidden states, then the MTP decoder layer (transformers' DeepSeek-V3 layer with the MTP
    weights) over x_t = eh_proj([enorm(embed(ids[t + 1])), hnorm(h_t)]), causal, its own
    output and draft fed back for each further step. Returns (drafts, top-2 logit margins)."""
    import transformers
    n_layers = hf.config.num_hidden_layers
    per_layer = ("mlp_layer_types", "layer_types")  # (rebuilt for n_layers + 1 layers)
    kw = {k: v for k, v in hf.config.to_dict().items() if k not in per_layer}
    cfg = getattr(transformers, f"{arch}Config")(**{**kw, "num_hidden_layers": n_layers + 1})
    layer = getattr(transformers, f"{arch}ForCausalLM")(cfg).model.layers[n_layers].float().eval()
    prefix = f"model.layers.{n_layers}."
    layer.load_state_dict({k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)
                           and not k[len(prefix):].startswith(("enorm", "hnorm", "eh_proj", "shared_head",
                                                               "embed_tokens"))}, strict=False)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * w

    w = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0]        # [len, H], final-normed
        emb = hf.model.embed_tokens.weight
        n = len(ids) - 1
        xs = [torch.cat([rms(emb[ids[t + 1]], w["enorm.weight"]), rms(h[t], w["hnorm.weight"])]) @ w["eh_proj.weight"].t()
              for t in range(n)]
        drafts, margins = [], []
        for j in range(k):
            x = torch.stack(xs)[None]
            pos = torch.arange(x.shape[1])[None]
            pe = hf.model.rotary_emb(x, pos)
            mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            out = out[0] if isinstance(out, tuple) else out
            logits = rms(out[0, -1], w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].t()
            top = logits.topk(2).values
            drafts.append(int(logits.argmax()))
            margins.append(float(top[0] - top[1]))
            xs.append(torch.cat([rms(emb[drafts[-1]], w["enorm.weight"]), rms(out[0, -1], w["hnorm.weight"])])
                      @ w["eh_proj.weight"].t())
    return drafts, margins


def test_mtp_drafts_match_transformers_reference(ds_mtp, monkeypatch):
    """Each proposal the engine made (cache reused across steps, rejected drafts trimmed)
    equals the reference's drafts for the request's tokens at that moment, where the
    reference's top two logits are not a near tie."""
    path, hf, extra = ds_mtp
    seen = record_proposals(monkeypatch)
    llm = LLM(str(path), **KW, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    llm.generate(_prompts(seed=8, lengths=(5, 12)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(seen) >= 4
    assert check_drafts(hf, extra, seen) >= len(seen)


def record_proposals(monkeypatch) -> list:
    """A list that collects (the request's tokens, its drafts) of every MTP proposal from now on."""
    seen = []
    orig = mtp_mod.MTPProposer.propose

    def recording(self, reqs, limits):
        p = orig(self, reqs, limits)
        seen.extend((list(r.all_token_ids), d) for r, d in zip(reqs, p.drafts) if d)
        return p

    monkeypatch.setattr(mtp_mod.MTPProposer, "propose", recording)
    return seen


def check_drafts(hf, extra, seen: list, arch: str = "DeepseekV3") -> int:
    """Assert each recorded proposal equals ``_reference_drafts`` up to the reference's first near
    tie; returns how many drafts were checked."""
    checked = 0
    for ids, drafts in seen:
        ref, margins = _reference_drafts(hf, extra, ids, len(drafts), arch)
        for j, (a, b, mg) in enumerate(zip(drafts, ref, margins)):
            if mg < 1e-4:
                break  # a near tie: later steps may differ legitimately
            assert a == b, (ids, j, drafts, ref)
            checked += 1
    return checked


def test_mtp_errors(tmp_path):
    make_tiny_deepseek(tmp_path, seed=2, num_hidden_layers=2)  # no MTP weights in the checkpoint
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(str(tmp_path), **KW, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_mtp_on_dummy_weights(tmp_path):
    """Dummy weights (``load_format="dummy"``, as the presets) get random MTP layers when the
    config has num_nextn_predict_layers, for speed runs; greedy output still equals the
    plain engine's."""
    make_tiny_deepseek(tmp_path, seed=3, num_hidden_layers=2, num_nextn_predict_layers=1)
    kw = dict(KW, load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(seed=5, lengths=(4, 9))
    plain = LLM(str(tmp_path), **kw)
    assert plain.engine.runner.model.mtp is None  # (built only for MTP speculation)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tmp_path), **kw, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert llm.engine.runner.model.mtp is not None
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.stats()["spec_draft_tokens"] > 0


def test_mtp_layers_are_allocated_in_the_model_dtype(tmp_path):
    """A bf16 model's MTP layers are created in bf16, never float32 first: on the H200 a float32
    first draft of DeepSeek-V3's MoE MTP layer (42 GiB) ran the 8-layer preset out of memory.
    Every tensor the factories return while the layers are built is watched, and the default
    dtype is restored afterwards."""
    make_tiny_deepseek(tmp_path, seed=3, num_hidden_layers=2, num_nextn_predict_layers=1)
    llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_blocks=32, load_format="dummy")
    model = llm.engine.runner.model
    with FactoryDtypes() as seen:
        mtp = model._new_mtp()
    assert seen.dtypes == {torch.bfloat16}
    assert {p.dtype for p in mtp.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
