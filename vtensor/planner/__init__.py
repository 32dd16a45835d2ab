"""The planner, pure and device-free: a profiled Trace in, a swap Plan out, cached by key."""
