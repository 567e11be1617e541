"""Model definitions. They build on worker/layers and know nothing of tensor parallelism or LoRA."""
