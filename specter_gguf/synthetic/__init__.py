"""Random-weight MoE models written as GGUF files in llama.cpp's exact tensor layout and metadata (the tiny models
of the tests, real shapes for the benchmark):

- `shapes`: :class:`~shapes.ModelShape`, a model's hyper-parameters, and the named presets;
- `architectures`: each architecture's tensors and metadata keys;
- `writer`: `write_synthetic` (how the weights are drawn, the tensor types) and `data_bytes`;
- `q8_0`: Q8_0 blocks as ggml's reference quantizer makes them, for targets written in Q8_0;
- `bpe`: the tiny models' byte-level BPE tokenizer and its trainer.
"""
