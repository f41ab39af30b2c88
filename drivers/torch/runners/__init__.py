"""The faster ways to run a pass than the eager model, each taken only where it applies: the
compiled CPU path (and the direct calls of its graphs), the fused C++ decode step, and CUDA graph
replay. `driver.py` holds the table that picks one; none of these knows about the others."""
