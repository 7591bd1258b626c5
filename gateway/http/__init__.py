"""What every HTTP route shares, below everything else in the gateway: the OpenAI error shape and its handlers
(`errors`), the request and response bodies (`schemas`) and the bounds on clients' JSON schemas (`json_schema`),
server-sent events and disconnects (`streaming`), the request-size limit (`body_limit`), the OpenAPI document's
extras (`openapi`), request ids and logging (`logging_setup`). A leaf: it imports no other gateway sub-package.
"""

__all__ = ["body_limit", "errors", "json_schema", "logging_setup", "openapi", "schemas", "streaming"]
