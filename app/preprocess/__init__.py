"""Chat templates, tokenizer loading, L0/L1 caches and the offload dispatcher.

The proxy needs only what is exported here: `Preprocessor` (build one at startup; it raises
`TokenizerLoadError` or `TemplateLoadError` for a bad `--tokenizer`/`--chat-template`),
`Prepared` (its result) and `PreprocessError` (a 400 for the client).
"""

from app.preprocess.chat_template import TemplateLoadError
from app.preprocess.errors import PreprocessError
from app.preprocess.pipeline import Prepared, Preprocessor
from app.preprocess.tokenizer_loading import TokenizerLoadError

__all__ = [
    "Prepared",
    "PreprocessError",
    "Preprocessor",
    "TemplateLoadError",
    "TokenizerLoadError",
]
