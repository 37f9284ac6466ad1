"""qworker: a queue-driven LLM inference worker."""

__version__ = "0.1.0"
