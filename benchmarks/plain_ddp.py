"""The baseline: a plain PyTorch DDP training script, launched by torchrun.

    torchrun --nproc_per_node 2 -m benchmarks.plain_ddp 300 [32768]    # steps, in-memory images
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from benchmarks.common import InMemoryData
from lit_dist.model.nets import SimpleCNN


def main(steps: int, num_samples: int = 32768, warmup: int = 20) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(SimpleCNN(num_classes=4), gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = InMemoryData(num_samples=num_samples)  # as bench_ddp gives lit-dist
    dataset = [{"image": data.images[i], "label": data.labels[i]} for i in range(len(data.labels))]
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=data.batch_size_per_device, sampler=sampler)
    step, epoch, first, start = 0, 0, None, None
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            if first is None:
                first = time.time()
            if step == warmup:
                start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    if rank == 0:
        print("BENCH " + json.dumps({"first_step_at": first, "steps_per_s": (steps - warmup) / elapsed}), flush=True)
    dist.barrier()  # both ranks done before either leaves
    # No teardown: the figure is taken. Freeing DDP's reducer and gloo's group at exit deadlocked in torch now and
    # then (the main thread, holding the GIL, joined gloo's loop, which waited for the GIL), and the benchmark hung.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
