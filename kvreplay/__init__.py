"""kvreplay: record, replay and check the KV-cache pool calls of LLM decode servers."""

__version__ = "0.1.0"
