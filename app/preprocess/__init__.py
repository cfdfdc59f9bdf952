"""Chat templates, tokenizer loading, L0/L1 caches and the offload dispatcher."""
