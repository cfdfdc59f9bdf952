"""The ASGI data path: parse -> preprocess -> route -> forward."""
