"""Compute kernels, each with a plain-PyTorch reference; torch is their only dependency."""
