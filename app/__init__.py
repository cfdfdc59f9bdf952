"""Sluice: a Trio LLM-serving proxy that tokenizes without freezing its event loop."""

__version__ = "0.1.0"
