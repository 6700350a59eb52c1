"""The multi-token-prediction layers of Qwen3-Next and Qwen3.5 (checkpoint ``mtp.*``), kept as the
model's ``mtp`` for MTP speculation (``spec/mtp.py``, docs/speculative.md).

The module predicts the token after next from the target's final-normed hidden state h_t at a
position and the embedding of the token t + 1 that follows it:
x = fc([pre_fc_norm_embedding(embed(token t + 1)) | pre_fc_norm_hidden(h_t)]) (``fc`` [H, 2H], no
bias), one decoder layer (``layers.0``: gated full attention, then the MLP of the model's layer 0:
an MoE block with its shared expert for the MoE models, a dense MLP for Qwen3.5), then ``norm``;
the logits come from the model's own lm_head, and the embedding is the model's (a checkpoint's
``mtp.embed_tokens`` copy is not kept). Every norm scales by (1 + w).

The layer's attention has cache index ``num_layers`` (past the model's layers): its K/V pages sit
in a cache tensor of their own that the target's block tables index (``spec/mtp.py``).
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.linear import Linear
from ..layers.norm import OffsetRMSNorm
from .llama import build_in_dtype

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


def num_mtp_layers(hf: dict) -> int:
    """The MTP layers a config declares (Qwen3-Next ``num_nextn_predict_layers``, Qwen3.5
    ``mtp_num_hidden_layers``); 0 when it declares none."""
    return int(hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers") or 0)


class HybridMTP(nn.Module):
    """``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``layers`` (decoder layers built
    by the model: gated attention at cache index num_layers + i) and ``norm``."""

    def __init__(self, cfg: ModelConfig, layers: list):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps)
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(h, eps)

    def inputs(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer input [T, H] from the embeddings of tokens t + 1 and the hidden states of
        positions t (the target's final-normed ones, or the module's own previous output)."""
        e = self.pre_fc_norm_embedding(embeds)
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], -1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, layer: int = 0) -> torch.Tensor:
        """Layer inputs x [T, H] at ``positions`` -> the final-normed output [T, H] (inside the
        runner's forward context: the attention reads and writes the paged cache)."""
        x, residual = self.layers[layer](positions, x, None)
        return self.norm(x, residual)[0]


class MTPLoading:
    """The MTP half of a hybrid model's loading (a mixin of ``Qwen3NextForCausalLM``): ``mtp`` is
    built when the first ``mtp.*`` tensor arrives (or by ``dummy_mtp``), its tensors copied as the
    model's own (``_load_mtp``), and ``check_mtp`` says whether the checkpoint held all of them.

    (The model's ``__init__`` sets ``mtp`` and ``_mtp_keys`` to None.)"""

    def make_mtp_layer(self, cfg: ModelConfig, i: int) -> nn.Module:
        raise NotImplementedError

    def _new_mtp(self, count: int) -> HybridMTP:
        # in the model's dtype (a Qwen3.5-397B MoE MTP layer is about 26 GB in float32), the (1 + w)
        # norms in fp32 as the model's
        mtp = build_in_dtype(self.model.embed_tokens.weight, lambda: HybridMTP(
            self.config, [self.make_mtp_layer(self.config, i) for i in range(count)]))
        self._mtp_keys = set()
        return mtp

    def _load_mtp(self, name: str, tensor) -> Optional[list]:
        """An ``mtp.*`` checkpoint tensor into ``mtp`` (built at the first one); the keys loaded."""
        from .deepseek_v3 import _copy_packed
        from ..layers.moe import load_expert_weight
        if name.startswith("mtp.embed_tokens."):
            return []  # (the model's embedding serves)
        m = _MTP_LAYER.match(name)
        if self.mtp is None:
            self.mtp = self._new_mtp(max(1, num_mtp_layers(self.config.text_config)))
        if m is not None and int(m[1]) >= len(self.mtp.layers):
            raise ValueError(f"checkpoint tensor {name!r}: the config declares {len(self.mtp.layers)} MTP layer(s)")
        keys = load_expert_weight(self, name, tensor)
        if keys is None:
            keys = self.load_by_owner(name, tensor)
        if keys is None:
            try:
                keys = [_copy_packed(self, self.packed_modules, name, tensor)]
            except ValueError:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}'s MTP layers") \
                    from None
        self._mtp_keys.update(keys)
        return keys

    def load_by_owner(self, name: str, tensor) -> Optional[list]:
        raise NotImplementedError

    def check_mtp(self) -> None:
        """Raise ValueError when the model has no MTP layers or the checkpoint missed some of
        their tensors (the loader's completeness check ran before ``mtp`` existed)."""
        if self.mtp is None:
            raise ValueError("speculative_config method 'mtp' needs a model with MTP layers (the checkpoint's "
                             "mtp.* tensors, or dummy weights with num_nextn_predict_layers / mtp_num_hidden_layers "
                             "in the config)")
        if self._mtp_keys is None:
            return  # (dummy weights)
        from ..loader.weights import _check_complete
        params = {f"mtp.{n}": p for n, p in self.mtp.named_parameters()}
        _check_complete(self, params, dict(self.named_modules()), self._mtp_keys)

    def dummy_mtp(self, seed: int) -> None:
        """Random MTP layers beside dummy weights (MTP speculation on a preset measures speed):
        the config's count, else one (the published checkpoints have one; vLLM's default too)."""
        if self.mtp is None:
            from ..loader.weights import init_dummy_weights
            self.mtp = self._new_mtp(max(1, num_mtp_layers(self.config.text_config)))
            self._mtp_keys = None
            init_dummy_weights(self.mtp, seed + 1)
