"""Preprocessing: a request body to its served model, prompt and token ids, one way.

The proxy needs `pipeline.Preprocessor` (build one at startup; it raises
`tokenizer_loading.TokenizerLoadError` or `chat_template.TemplateLoadError` for a bad
`--tokenizer`/`--chat-template`) and its result, `pipeline.Prepared`; a bad request raises
`app.errors.ClientError`. The walk: request_bodies.py (parse, check) -> app/models.py
(resolve) -> rendering.py (render), composed once in to_prompt.py -> length_gate.py ->
tokenization.py (L0, L1, the offload dispatchers). Nothing is imported here: a render worker
process imports only to_prompt.py and what it needs, not the tokenizer's threads nor Trio's
loop.
"""
