"""Runtime kernels the graph passes insert, one per file, usable directly: Tempo's memory-saving autograd
Functions (gelu, layer_norm, bit_dropout, attention) and their nn.Module faces (tempo_modules), with their
buffers and bit packing; hash_dropout; materialize.  Import from the modules (the package re-exports nothing,
so no module is shadowed by a function of its own name)."""
