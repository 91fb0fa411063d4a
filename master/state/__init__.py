"""The master's durable state: the store interface, SQLite and etcd stores, the job's record."""
