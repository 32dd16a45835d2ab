"""DemandLayering: inference with weights streamed layer by layer from an aligned weight file."""
