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
        try:
            res = fn(**kwargs)
        except BaseException as exc:      # the parent raises it at once instead of waiting out its timeout
            queue.put((rank, RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")))
            raise
        queue.put((rank, res))
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
            results = {}
            for _ in procs:
                r, res = queue.get(timeout=timeout)
                if isinstance(res, RuntimeError) and str(res).startswith(f"rank {r}: "):
                    raise res
                results[r] = res
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]


def interleaved_rounds(variants: dict, rounds: int, calls: int) -> dict:
    """Per variant, ``rounds`` samples of seconds per call: each sample ``calls`` calls back to
    back after a barrier over the default group; the variants' order rotates every round."""
    import time
    names = list(variants)
    times: dict = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for n in names[shift:] + names[:shift]:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                variants[n]()
            times[n].append((time.perf_counter() - t) / calls)
    return times


def paired_lines(rows: list, base: str) -> list:
    """From every rank's :func:`interleaved_rounds` result: one line per variant, the median
    ms per call of the slower rank and the median over the rounds of its ratio to ``base``."""
    import statistics
    per = {n: [max(ts) for ts in zip(*(r[n] for r in rows))] for n in rows[0]}
    lines = []
    for n, ts in per.items():
        paired = statistics.median(a / b for a, b in zip(ts, per[base]))
        lines.append(f"  {n:30s} {statistics.median(ts) * 1e3:7.3f} ms  {paired:.3f}")
    return lines
