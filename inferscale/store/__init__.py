"""The store: Chroma (the system of record), the device index and BM25 over it, metadata
filters, the turn log, the history, and the SQL and SQLite plumbing under them."""
