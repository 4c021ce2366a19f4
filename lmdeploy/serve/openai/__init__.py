"""OpenAI-compatible HTTP serving: `create_app(async_engine, ...)` builds the FastAPI app, `serve(...)` runs it."""
from .api_server import create_app, serve

__all__ = ['create_app', 'serve']
