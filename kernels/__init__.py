"""Compute kernels, each with a plain-PyTorch reference; they depend on torch alone (and on Triton
for their CUDA variants, imported only when the tensors are on a GPU).

Imported as `megarl.kernels`: the link megarl/kernels points at this folder (see setup.py)."""
