"""The target's hidden states: the cache stage (capture.py), the cache's on-disk format and reader (cache.py) and
writer (cache_writer.py), states from a serving engine (engine.py), and online states computed during training
(online.py)."""
