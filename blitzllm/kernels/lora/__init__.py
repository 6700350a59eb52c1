"""LoRA products of a batch where each row has its own adapter slot (``bgmv.py``)."""
