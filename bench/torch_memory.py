"""Peak GPU memory and loss curve: odc.torch vs plain FSDP2, same model, data and schedule.

Runs a packed-document causal LM (tests/python/tiny_lm.py, here ~0.5B parameters) on every GPU
(one process each), bf16 parameters / fp32 reduction, LB-Micro plans (equal microbatch counts, so
plain FSDP2 can run them). Peak = torch.cuda.max_memory_allocated plus odc's symmetric buffers
(allocated by libodc), slowest rank. Prints a table; not a test.
Usage: python bench/torch_memory.py [dim] [layers] [max_tokens]
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from tiny_lm import plans, train  # noqa: E402


def main():
    dim = int(sys.argv[1]) if len(sys.argv) > 1 else 1536
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    world_size = torch.cuda.device_count()
    model = dict(vocab=32000, dim=dim, hidden=4 * dim, heads=dim // 128, layers=layers)
    data = dict(num_samples=4 * world_size, shortest=256, longest=max_tokens, vocab=32000)
    schedule = plans(world_size, "lb-micro", max_tokens=max_tokens, **data)
    options = dict(device="cuda", bf16=True, model=model, data=data, lr=3e-4)
    rows = {}
    for name, use_odc in (("fsdp2", False), ("odc", True)):
        results = train(world_size, schedule, use_odc, **options)
        rows[name] = (max(r[3] for r in results), results[0][2])
    params = 2 * 32000 * dim + layers * (3 * dim * dim + dim * dim + 8 * dim * dim)
    print(
        f"{world_size} GPUs, ~{params / 1e9:.2f}B parameters, dim {dim}, {layers} layers, "
        f"samples 256..{max_tokens} tokens, {data['num_samples']} per minibatch, bf16/fp32"
    )
    print(f"{'mode':6} {'peak GiB':>9} {'vs fsdp2':>9}  losses per step")
    for name, (peak, losses) in rows.items():
        ratio = peak / rows["fsdp2"][0]
        print(f"{name:6} {peak / 2**30:9.2f} {ratio:8.3f}x  {' '.join(f'{x:.4f}' for x in losses)}")


if __name__ == "__main__":
    main()
