"""blitzllm: a fast, readable LLM inference and serving engine.

The public API: ``LLM``, ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``,
``BeamSearchParams``, ``LoRARequest``, and for pooling models ``PoolingParams``,
``EmbeddingRequestOutput``, ``EmbeddingOutput``, ``ClassificationRequestOutput``,
``ClassificationOutput``, ``ScoringRequestOutput``, ``ScoringOutput`` (imported on first use, so
``python -m blitzllm.<module>`` and the CLI stay light)."""
import importlib

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams", "LoRARequest",
           "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput", "ClassificationRequestOutput",
           "ClassificationOutput", "ScoringRequestOutput", "ScoringOutput"]
__version__ = "0.1.0"

_WHERE = {"LLM": ".llm", "SamplingParams": ".sampling_params", "RequestOutput": ".engine.request",
          "CompletionOutput": ".engine.request", "BeamSearchParams": ".engine.beam_search", "LoRARequest": ".lora",
          "PoolingParams": ".pooling_params", "EmbeddingRequestOutput": ".engine.request",
          "EmbeddingOutput": ".engine.request", "ClassificationRequestOutput": ".engine.request",
          "ClassificationOutput": ".engine.request", "ScoringRequestOutput": ".engine.request",
          "ScoringOutput": ".engine.request"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module 'blitzllm' has no attribute {name!r}")
