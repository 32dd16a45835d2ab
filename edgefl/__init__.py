"""edgefl: Flower apps whose clients train under vtensor memory budgets."""

__version__ = "0.1.0"
