"""Saved tensors as vTensors: chunks in and out of the device, through the storage tier."""
