"""atomlog partition server."""
