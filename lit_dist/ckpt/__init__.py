"""Checkpoints: written whole or not at all (``files``, ``store``, ``saver``, ``sharded``, ``snapshot``, ``io``),
chosen and checked for a resume (``resume``, ``match``), unpickled only as far as trusted (``pickles``,
``vetting``), and exported as a plain network (``export``)."""
