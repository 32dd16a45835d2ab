"""Recomputation: modules run again in backward under torch's checkpointing; profile/ apart."""
