"""pippy_split: pipeline parallelism for ordinary PyTorch models."""
