"""The prefill worker: computes prompts and hands their KV to a decode worker."""
