"""bench/vllm_peer.py (``--compare vllm``): vLLM is optional, so without it the peer is a
clear error (a ValueError, one CLI line and exit 2), as is a model that is not an HF folder."""
import sys
import types

import pytest

from blitzllm.bench.vllm_peer import VllmPeer
from blitzllm.cli import main


def test_without_vllm_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)   # (import vllm raises ImportError)
    with pytest.raises(ValueError, match="needs vLLM installed"):
        VllmPeer("/x", "bfloat16", [[1, 2]], 4, 16)
    code = main(["bench", "latency", "--model", "/no/such/folder", "--device", "cpu",
                 "--input-len", "4", "--output-len", "2", "--compare", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vLLM" in err[0]


def test_model_must_be_an_hf_folder(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    with pytest.raises(ValueError, match="HF folder"):
        VllmPeer(str(tmp_path), "bfloat16", [[1, 2]], 4, 16)
