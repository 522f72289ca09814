"""The attention layer over the cache: `DSV4Attention` (layer.py), its weights (weights.py), its streams
(streams.py) and the layers-only CUDA-graph decode step (graph.py)."""
