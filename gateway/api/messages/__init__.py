"""`/v1/messages`, Anthropic's Messages API, as a translator over the chat pipeline: `protocol` (the request and
the `message`), `translate` (content blocks → chat turns, tools, `tool_choice`), `serving` (the message, its
stream events and Anthropic's error shape) and `router`."""

__all__ = ["protocol", "router", "serving", "translate"]
