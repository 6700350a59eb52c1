"""Multi-LoRA serving (vLLM's names): ``LoRARequest`` names an adapter for a request; the
adapter folder is read and checked by ``adapter.py``, and ``manager.py`` wraps the model's
linears at runner build time and keeps adapters in a pool of ``max_loras`` slots.

This package sits between the runner and the models: the engine, the server and ``llm.py``
import ``LoRARequest`` from here; the runner builds the ``LoRAManager``."""
from .request import LoRAConfig, LoRARequest

__all__ = ["LoRAConfig", "LoRARequest"]
