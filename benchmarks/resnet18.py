"""ResNet-18 benchmark: DDP against the PS modes on CIFAR-shaped FakeData.

Runs ``examples/resnet18.py`` with every variant and stores its rows, with the
date, commit and machine, in ``benchmarks/results/resnet18.json``; extra arguments
are passed through.

    python benchmarks/resnet18.py [--steps 20] [--batch 16]
"""

import json
import runpy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _common

OUT = Path(__file__).resolve().parent / "results" / "resnet18.json"

if __name__ == "__main__":
    example = Path(__file__).resolve().parent.parent / "examples" / "resnet18.py"
    passed = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp, "rows.json")
        sys.argv = [
            str(example),
            "--variants",
            "ddp,ps_sync,ps_async,ps_sync_bf16",
            *passed,
            "--out",
            str(rows_file),
        ]
        runpy.run_path(str(example), run_name="__main__")
        rows = json.loads(rows_file.read_text())
    OUT.write_text(json.dumps({**_common.machine_info(), "args": passed, "rows": rows}, indent=2))
    print(f"wrote {OUT}")
