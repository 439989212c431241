"""Steps/s with the GPU circuit breaker (NVML test double, 1 s polls) and webhooks (a local server
that answers after 2 s) vs without either, same model (SimpleCNN) and in-memory data, runs
alternating, medians of ``--repeats`` runs each.

Target (issue 5): ratio >= 0.99.

    .venv/bin/python -m benchmarks.bench_callbacks_overhead [--repeats 5] [--steps 400] [--short]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmarks.common import SHORT_HELP, machine, result_line, run_bench


class SlowHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(2)  # a slow receiver: training must not notice
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--short", action="store_true", help=SHORT_HELP)
    args = parser.parse_args()
    if args.short:  # past StepTimer's 20 warm-up steps
        args.repeats, args.steps = 1, 30
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tmp = tempfile.mkdtemp(prefix="lit-dist-bench-")
    state = os.path.join(tmp, "nvml.json")
    with open(state, "w") as f:
        json.dump({"0": {}}, f)
    os.environ.update(FAKE_NVML_STATE=state, BENCH_HOOK_URL=f"http://127.0.0.1:{server.server_address[1]}/hook")
    base = [os.path.join(os.path.dirname(sys.executable), "lit-dist"), "fit", "--trainer.max_steps", str(args.steps),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
            "--trainer.callbacks+=benchmarks.common.StepTimer", "--run.root_dir", tmp,
            "--model.net", "lit_dist.model.nets.SimpleCNN", "--model.net.num_classes", "4",
            "--data", "benchmarks.common.InMemoryData"]
    with_callbacks = base + [
        "--trainer.callbacks+=lit_dist.callbacks.circuit_breaker.GPUCircuitBreaker",
        "--trainer.callbacks.poll_interval_s", "1", "--trainer.callbacks.nvml_module", "tests.helpers.fake_nvml",
        "--trainer.callbacks.device_index", "0",
        "--trainer.callbacks+=lit_dist.callbacks.webhooks.WebhookNotifier",
        "--trainer.callbacks.sinks", '[{"kind": "raw", "url_env": "BENCH_HOOK_URL"}]',
        "--control.progress_every_s", "5", "--trainer.callbacks.flush_timeout_s", "0"]
    results: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(args.repeats):
        order = (("with", with_callbacks), ("without", base)) if i % 2 == 0 else (("without", base), ("with", with_callbacks))
        for name, cmd in order:
            results[name].append(run_bench(cmd)["steps_per_s"])
    server.shutdown()
    med = {k: statistics.median(v) for k, v in results.items()}
    ratio = med["with"] / med["without"]
    print(f"machine: {machine()}; SimpleCNN, in-memory data, {args.steps} steps, median of {args.repeats}")
    print(f"  with breaker + webhooks  {med['with']:8.2f} steps/s")
    print(f"  without                  {med['without']:8.2f} steps/s")
    print(f"ratio: {ratio:.3f}  (target >= 0.99) {'OK' if ratio >= 0.99 else 'MISSED'}")
    result_line("callbacks_overhead", round(ratio, 4), ">= 0.99", ratio >= 0.99,
                with_steps_per_s=round(med["with"], 2), without_steps_per_s=round(med["without"], 2),
                steps=args.steps, repeats=args.repeats, short=args.short)


if __name__ == "__main__":
    main()
