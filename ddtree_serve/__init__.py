"""ddtree-serve: speculative decoding with DDTree draft trees over a DFlash drafter, served on Ray Serve."""

__version__ = "0.1.0"
