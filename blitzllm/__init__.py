"""blitzllm: a fast, readable LLM inference and serving engine."""
from .sampling_params import SamplingParams
from .engine.request import CompletionOutput, RequestOutput
from .llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
