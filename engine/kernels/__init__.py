"""Triton GPU kernels of the fast frame path: fused transformer-block ops, varlen attention, one-kernel sampling."""
