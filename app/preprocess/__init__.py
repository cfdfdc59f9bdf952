"""Chat templates, tokenizer loading, L0/L1 caches and the offload dispatchers.

The proxy needs `pipeline.Preprocessor` (build one at startup; it raises
`tokenizer_loading.TokenizerLoadError` or `chat_template.TemplateLoadError` for a bad
`--tokenizer`/`--chat-template`) and its result, `pipeline.Prepared`; a bad request raises
`app.http.errors.ClientError`. Nothing is imported here: a render worker process imports only
rendering.py and what it needs, not the tokenizer nor Trio.
"""
