"""Write the regression notebooks' sources (outputs come from running them).

    python notebooks/make_notebooks.py           # writes the .ipynb files, no outputs
    python notebooks/make_notebooks.py --execute # and executes them in a real kernel,
                                                 # storing real outputs (what nbval compares)
"""
from __future__ import annotations

import os
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))


def quickstart():
    return [
        new_markdown_cell(
            "# accel_magics quickstart\n\n"
            "`%%distributed` runs a cell on several worker processes (ranks) with the torchrun "
            "environment set. Here: 2 ranks on CPU with the gloo backend."
        ),
        new_code_cell("%load_ext accel_magics"),
        new_markdown_cell("Ordinary cells define what the ranks use: functions, constants, data."),
        new_code_cell(
            "import torch\n\n"
            "SCALE = 10\n\n"
            "def contribution(rank):\n"
            "    \"\"\"What each rank adds to the sum.\"\"\"\n"
            "    return torch.tensor([float((rank + 1) * SCALE)])"
        ),
        new_markdown_cell(
            "The distributed cell: every rank runs it; output comes back tagged by rank. "
            "`--return total` brings rank 0's `total` back into the notebook."
        ),
        new_code_cell(
            "%%distributed --num_processes 2 --output text --return total\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group(\"gloo\")\n"
            "rank = dist.get_rank()\n"
            "total = contribution(rank)\n"
            "dist.all_reduce(total)\n"
            "print(f\"rank {rank} of {dist.get_world_size()}: sum = {total.item():g}\")\n"
            "dist.destroy_process_group()"
        ),
        new_code_cell("total"),
    ]


NOTEBOOKS = {"quickstart.ipynb": quickstart}


def main() -> None:
    execute = "--execute" in sys.argv
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=cells())
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = os.path.join(HERE, name)
        if execute:
            from nbconvert.preprocessors import ExecutePreprocessor
            ExecutePreprocessor(timeout=600, kernel_name="python3").preprocess(nb, {"metadata": {"path": HERE}})
        nbformat.write(nb, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
