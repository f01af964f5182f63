"""atomlog id allocator."""
