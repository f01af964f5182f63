"""atomlog coordinator."""
