"""A small zoo of edge models defined in code (no downloads)."""

from edgefl.models.registry import MODEL_NAMES, build_model

__all__ = ["MODEL_NAMES", "build_model"]
