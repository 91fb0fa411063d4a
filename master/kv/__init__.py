"""The master's key-value store behind torch's `Store` (its gRPC service lives in `master.rpc`)."""
