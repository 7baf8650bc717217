"""Generation: the knobs of one request (options), tool calling, the prompt layout around
the memory block, and the request builder (retrieval, layout, KV readiness, the plan)."""
