"""Passes on an nn.Module: the model in, the same model out (see comera_compile.passes)."""
