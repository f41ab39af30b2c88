"""The torch driver: real models on a paged KV cache behind the bridge (Triton on CUDA, plain
torch on the CPU). The only package of wafer that imports torch or triton."""
