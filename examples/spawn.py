"""Run an example on N CPU processes without torchrun:

    python examples/spawn.py examples/llama_sp.py            # 2 ranks (gloo)
    python examples/spawn.py --nproc 4 examples/llama_sp.py

Each rank gets torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), loads the script
and calls its ``main()``: the same as ``torchrun --nproc_per_node N script``."""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def _rank(rank: int, path: str, nprocs: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nprocs),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    spec = importlib.util.spec_from_file_location("example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.main()
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("script", help="an example script with a main() function")
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(os.path.abspath(args.script), args.nproc, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    sys.exit(main())
