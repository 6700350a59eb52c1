"""``blitz router``: an OpenAI-compatible proxy in front of blitz (or vLLM-style) servers. With
``--prefill`` / ``--decode`` it runs each request's prefill on a producer and its decode on a
consumer, which pulls the KV (``blitzllm/kv_transfer``); with ``--backend`` it balances plain
replicas, optionally by conversation prefix. It keeps no KV and imports no engine code
(docs/disaggregation.md).
"""
