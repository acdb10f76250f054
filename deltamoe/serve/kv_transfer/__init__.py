"""Prefill/decode hand-off: a connector interface in the shape of vLLM's KV connector, and its
Mooncake transfer-engine implementation (paged latent-KV blocks, indexer keys, KDA state)."""
