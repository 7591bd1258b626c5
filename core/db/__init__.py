"""SQL storage: the schema (`models`) and connections plus migrations (`database`)."""

__all__ = ["database", "models"]
