"""atomlog spark client."""
