"""While profiling: which modules are safe to recompute, and what recomputing each costs."""
