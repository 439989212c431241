"""Reading samples, below both ``lit_dist.data`` and ``lit_dist.cache``: what counts as an unreadable sample,
how an image file's bytes are decoded to cover its bucket, where the image is cropped, which order a caption's
tags are read in, whether the table's files are there, hashing a column of names, and how the worker processes
that decode images start. The data module and the caches both build on these; neither reaches into the other for
them (``tests/unit/test_layers.py``)."""
