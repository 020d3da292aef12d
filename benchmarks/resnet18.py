"""ResNet-18 benchmark: DDP against the PS modes on CIFAR-shaped FakeData.

Runs ``examples/resnet18.py`` with every variant and stores the rows in
``benchmarks/results/resnet18.json``; extra arguments are passed through.

    python benchmarks/resnet18.py [--steps 20] [--batch 16]
"""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    example = Path(__file__).resolve().parent.parent / "examples" / "resnet18.py"
    sys.argv = [
        str(example),
        "--variants", "ddp,ps_sync,ps_async,ps_sync_bf16",
        "--out", "benchmarks/results/resnet18.json",
        *sys.argv[1:],
    ]
    runpy.run_path(str(example), run_name="__main__")
