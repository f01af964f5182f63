"""Generated protobuf and gRPC code for atomlog's API (package atomlog.v1)."""
