"""Replacing transformers' layer forwards while decoding: the decoding mode a call runs its decoder layers in
(`mode`: as they are, fused norms, compiled), the fused stock layers (`layers`) and MoE experts (`experts`), and which
experts modules a CUDA graph can capture (`capture`). Everything is restored after the call (docs/kernels.md)."""
