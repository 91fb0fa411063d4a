"""Data sharding: datasets as record ranges, the todo/doing/done ledger, and the shard service."""
