"""The graft library seen from a query: the store's index, retrieval, and replay lookup by prompt hash."""
