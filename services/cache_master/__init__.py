"""The cache master: metadata of the distributed KV pool (never its bytes)."""
