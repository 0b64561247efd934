"""Time an engine checkpoint's save and load on the CPU, one process: DCP (format 3) against the
per-(pp, tp) files of format 2 (the engine's state dict through torch.save, as before DCP).

Builds a llama of HIDDEN x LAYERS (vocab 4096) with an fp32 AdamW engine, takes no step (the
moments are allocated, so the bytes are a trained engine's), and saves and loads each way
three times, printing the median. Usage: PYTHONPATH=. python
docs/scripts/bench_engine_checkpoint.py [HIDDEN] [LAYERS] [FOLDER].
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import rlhf.engine.checkpoint as ckpt
from rlhf.config.schema import OptimizerConfig, TinyModelConfig
from rlhf.demo.tiny_model import make_tiny_model
from rlhf.engine import TrainEngine
from rlhf.files import atomic_write
from rlhf.parallel.launch import free_port
from rlhf.parallel.mesh import ParallelMesh, ProcessGroupCache


def _save_format2(engine: TrainEngine, folder: Path) -> None:
    with atomic_write(ckpt.shard_file(folder, engine.mesh), "wb") as f:
        torch.save({**engine.state_dict(), ckpt.EXPERTS_KEY: False}, f)


def _median(fn) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    hidden = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    root = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(tempfile.mkdtemp())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    spec = TinyModelConfig(num_layers=layers, hidden_size=hidden, num_heads=hidden // 64,
                           num_kv_heads=hidden // 128, intermediate_size=hidden * 11 // 4,
                           vocab_size=4096, max_position_embeddings=256)
    folder = make_tiny_model(spec, root / "model")
    mesh = ParallelMesh([0], cache=ProcessGroupCache())
    engine = TrainEngine.from_pretrained(folder, mesh=mesh, optim=OptimizerConfig())
    params = sum(p.numel() for p in engine.model.parameters())
    print(f"llama hidden={hidden} layers={layers}: {params / 1e6:.0f}M parameters, "
          f"{params * 12 / 2**30:.2f} GiB of weights and moments (fp32)")
    dcp_dir, old_dir = root / "dcp", root / "format2"
    save_dcp = _median(lambda: engine.save_checkpoint(dcp_dir))
    save_old = _median(lambda: _save_format2(engine, old_dir))
    load_dcp = _median(lambda: engine.load_checkpoint(dcp_dir))
    load_old = _median(lambda: engine.load_checkpoint(old_dir))
    print(f"save: DCP {save_dcp:.2f} s, format 2 {save_old:.2f} s")
    print(f"load: DCP {load_dcp:.2f} s, format 2 {load_old:.2f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
