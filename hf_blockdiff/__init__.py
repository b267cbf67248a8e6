"""hf_blockdiff: fast block-diffusion decoding inside Hugging Face transformers."""

__version__ = "0.1.0"
