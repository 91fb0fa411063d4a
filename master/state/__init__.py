"""The master's durable state: the store interface, SQLite and etcd stores, and the job's own record."""
