"""Replaying a plan: the executor of its moves, and its one lean form (NOTE [lean replay])."""
