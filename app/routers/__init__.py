"""HTTP routes: thin, they parse, call a service and return a schema."""
