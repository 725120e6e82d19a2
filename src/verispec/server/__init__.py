"""OpenAI-compatible HTTP server: one engine thread, continuous batching, streaming, metrics."""

from .app import ServerConfig, ServerState, create_app

__all__ = ["ServerConfig", "ServerState", "create_app"]
