"""How many bytes are in use: allocator counters, RSS, and the dispatch tracker that checks them."""
