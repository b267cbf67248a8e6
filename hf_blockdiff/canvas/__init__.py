"""DiffusionGemma's canvas denoising: the whole generation decided over a fixed number of steps instead of block by
block. `schedule` holds the pure rules (temperatures, acceptance, noise, stopping), `loop` the engine that runs them
over the paged cache, `diffusion_gemma` the entry point on transformers' DiffusionGemma model (docs/fidelity.md,
"DiffusionGemma"). Its scoring kernel is `kernels/canvas_scoring.py`, its bench `tools/diffusion_gemma_bench.py`."""
