"""FX passes, each usable on its own on any GraphModule; installed as comera_compile.passes."""
