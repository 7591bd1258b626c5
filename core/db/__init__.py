"""SQL storage: the schema (`models`) and connections plus migrations (`database`)."""
