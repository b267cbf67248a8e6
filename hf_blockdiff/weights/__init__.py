"""What the model's weights are while decoding: PEFT adapters merged for a call and restored bit-exactly (`lora`),
quantized weights on the fast path (`quantization`), weights sharded by transformers' tensor parallelism
(`tensor_parallel`) (docs/architecture.md, "Around the loop")."""
