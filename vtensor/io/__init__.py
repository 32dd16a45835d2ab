"""Bytes leaving memory, shared by every feature: chunks, slower tiers, sealing, async transfers."""
