"""Token budgets per API key and model: buckets in one process, shared through Redis."""
