"""State: the durable store (SQLite, or PostgreSQL for high availability) and the
leadership elected in it."""
