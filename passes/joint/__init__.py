"""Passes on Inductor's joint forward + backward graph (see comera_compile.passes)."""
