"""Weights from checkpoint to device: loaders (safetensors, GGUF and its tokenizer), LoRA
adapters, and the load-time transforms (fused projections, SmoothQuant, int8, the float32 CPU
layout, the int8 weight arena). Knows nothing of passes, pages or how a pass is run."""
