"""What runs a run, below every component: its processes and how they end (``processes``, ``roll_call``,
``last_resort``, ``orphan_guard``), where they come from (``launch``, ``slurm``, ``run_dir``), how they agree
(``distributed``, and ``control``: the run control, the one exchange and event publisher components talk through),
waiting out an object store (``outage``), Lightning's private state (``compat``) and optional packages
(``extras``)."""
