"""Command line, demo and plots; may import all of vtensor, and no vtensor module imports them."""
