"""The compute kernels under the model's ops: the C++ CPU kernels and their build, the Triton
attention kernel, the plain-torch reference attention, and the per-layer `Attend` callable that
picks among them. Knows nothing of checkpoints, requests or the bridge."""
