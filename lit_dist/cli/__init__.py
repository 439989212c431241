"""The ``lit-dist`` command line (entry band): ``app.py`` (LitDistCLI: LightningCLI with lit-dist's defaults, and
``main``, which maps faults to exit codes), ``commands/`` (one module per command of lit-dist's own, and the table
of every command), ``saved_config.py`` (the run's config.yaml), ``pipeline.py`` (the ``pipeline`` group: what a
diffusers pipeline folder fills in) and ``predictions.py`` (predict's parquet files)."""
