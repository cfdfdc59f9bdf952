"""Chat templates, tokenizer loading, L0/L1 caches and the offload dispatcher.

The proxy needs only what is exported here: `Preprocessor` (build one at startup; it raises
`TokenizerLoadError` or `TemplateLoadError` for a bad `--tokenizer`/`--chat-template`),
`Prepared` (its result); a bad request raises `app.errors.ClientError`.
"""

from app.preprocess.chat_template import TemplateLoadError
from app.preprocess.pipeline import Prepared, Preprocessor
from app.preprocess.tokenizer_loading import TokenizerLoadError

__all__ = [
    "Prepared",
    "Preprocessor",
    "TemplateLoadError",
    "TokenizerLoadError",
]
