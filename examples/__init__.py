"""Example models and scripts; installed as comera_compile.examples."""
