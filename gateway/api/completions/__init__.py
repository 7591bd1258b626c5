"""OpenAI's (legacy) completions, as a room of its own: the route (`router`) and its answers' shapes (`serving`)."""

__all__ = ["router", "serving"]
