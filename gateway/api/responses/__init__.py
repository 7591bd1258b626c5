"""`/v1/responses`, OpenAI's Responses API, as a translator over the chat pipeline: `protocol` (the request and the
`response` object), `translate` (input items → chat turns, tools, `text.format`), `serving` (the response and its
typed stream events), `store` (the state the gateway owns: stored responses per tenant, expiring) and `router`."""

__all__ = ["protocol", "router", "serving", "store", "translate"]
