"""The shapes demo: its dataset (shapes.py: circles, squares, triangles and crosses in colours, with captions) and
its judge of generated images (judge.py: ``samples.judge`` for the t2i quickstart)."""
