"""Tools: commands built on the library, reached through the `hf-blockdiff` command line.

`bench` (hf_blockdiff against the plain-HF reference loop, and with `--kernels` the kernel microbenchmarks of
`microbench`), `demo` (the bundled tiny model on held-out problems of the synthetic task in `tasks`) and
`train-tiny` (`train_tiny`, which trains that model). They use the library's public API; the library never imports
them.
"""
