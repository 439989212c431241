"""``lit-dist report RUN_DIR``: a run's summary for a login node or an ssh session without TensorBoard.

    lit-dist report runs/quickstart/slurm-4242
    lit-dist report runs/quickstart/slurm-4242 --plot report.png
"""

from lit_dist.watch.report import read


def report(run_dir: str, plot: str | None = None) -> None:
    """Summarise a run, finished or still running: state and ETA, config changes, metrics, throughput, goodput,
    attempts and checkpoints.

    Args:
        run_dir: The run directory, {run.root_dir}/{run.name}/{run.run_id} (printed at the start and end of fit).
        plot: Also draw loss, accuracy, learning rate and throughput over steps into this image file (e.g. report.png).
    """
    found = read(run_dir)
    print(found.text())
    if plot:
        found.plot(plot)
        print(f"  plot: {plot}")
