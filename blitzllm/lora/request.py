"""What a caller names (``LoRARequest``, vLLM's class) and what the engine is built with
(``LoRAConfig``, from EngineArgs' enable_lora / max_loras / max_lora_rank / max_cpu_loras)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request: ``lora_int_id`` (>= 1) identifies it in the engine (the slot
    pool, the prefix cache), ``lora_path`` is a local PEFT adapter folder."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a local adapter folder, got {self.lora_path!r}")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1          # distinct adapters in one batch (GPU slots)
    max_lora_rank: int = 16     # slots are this wide; a larger adapter rank is refused
    max_cpu_loras: Optional[int] = None  # adapters kept read in host memory (default max_loras)

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        c = self.max_cpu_loras
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {c!r}")
