"""Passes on a torch.fx GraphModule (a trace, or dynamo's graph with fake values), in place, returning a
GraphPassResult (see comera_compile.passes)."""
