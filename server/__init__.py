"""Weir's OpenAI-compatible HTTP server (starlette + uvicorn)."""
