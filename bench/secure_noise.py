"""Cost of secure-mode DP noise: ChaCha20 Gaussians (pipeline/privacy/noise.py) against torch's mt19937.

For one noise draw the size of a model's trainable parameters (default 10M floats; GPT-2
small has 124M), the median time of Opacus' `_generate_noise` with a torch.Generator (what
`teacher.secure_mode=false` uses: one Gaussian per parameter) and with the ChaCha20 CSPRNG
(`secure_mode=true`: 4 Box–Muller Gaussians per parameter, summed, in float64), measured
alternately in one process, and their ratio. One DP step adds one such draw, so
secure mode adds about that time to every step. Run from the repository root:

    .venv/bin/python bench/secure_noise.py                 # 10M parameters, ~1 min on 2 cores
    .venv/bin/python bench/secure_noise.py --params 124000000
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from opacus.optimizers import optimizer as opacus_optimizer

from pipeline.privacy import noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    reference = torch.zeros(args.params)
    sources = {
        "torch mt19937 (secure_mode=false)": noise.generator("noise", secure=False),
        "ChaCha20 CSPRNG (secure_mode=true)": noise.generator("noise", secure=True),
    }
    times: dict[str, list[float]] = {k: [] for k in sources}
    for _ in range(args.repeats):
        for name, gen in sources.items():  # alternate, so background load hits both alike
            t0 = time.perf_counter()
            opacus_optimizer._generate_noise(std=1.0, reference=reference, generator=gen)
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(next(iter(times.values())))
    print(f"noise for {args.params:,} parameters, median of {args.repeats}, torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        print(f"  {name:36s} {statistics.median(ts):8.3f} s   ratio {statistics.median(ts) / base:6.1f}")


if __name__ == "__main__":
    main()
