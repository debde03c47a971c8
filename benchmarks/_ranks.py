"""Run a function on N spawned gloo ranks (127.0.0.1) and collect every rank's result."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world, init, fn, kwargs, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        queue.put((rank, fn(**kwargs)))
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn, world: int = 2, timeout: float = 900, **kwargs) -> list:
    """``[fn(**kwargs) on rank 0, ..., on rank world-1]``; ``fn`` must be importable."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "rdzv")
        procs = [ctx.Process(target=_worker, args=(r, world, init, fn, kwargs, queue)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = dict(queue.get(timeout=timeout) for _ in procs)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]
