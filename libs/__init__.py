"""Tandem: PD-disaggregated LLM serving with a cluster-wide KV cache pool."""
