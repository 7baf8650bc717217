"""Facts: the write path of memories in the core. It owns ordered, locked writes and reads
of facts (``writes.FactService``: Chroma, then the index, the KV invalidation and the
history) and LLM fact extraction and reconciliation for ``infer=True`` (``extraction``).
The package imports nothing: import the module you need."""
