"""The MemoryManager: saved activations swapped in chunks under a budget, planned and replayed."""
