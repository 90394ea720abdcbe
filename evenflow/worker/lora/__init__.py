"""LoRA on the worker: adapter tensors in host memory, a fixed pool of device slots, the batched apply."""
