"""Compute kernels. Each Triton kernel has a plain-torch reference beside it; nothing here imports the rest of
hf_blockdiff."""
