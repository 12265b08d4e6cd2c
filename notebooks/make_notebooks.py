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



TUTORIAL_DATA = '''import os, re
import numpy as np
import torch
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, Dataset
from accelerate import Accelerator
from accelerate.utils import set_seed

# No downloads: a small synthetic "pets" data set, made here. Each breed is a
# brightness pattern (which quadrant of a 32x32 image is lit), plus noise.
BREEDS = ["beagle", "persian", "pug", "siamese"]

def make_image(label_id, rng):
    image = rng.normal(0.0, 1.0, size=(3, 32, 32)).astype("float32")
    row, col = divmod(label_id, 2)
    image[:, row * 16:(row + 1) * 16, col * 16:(col + 1) * 16] += 0.12
    return torch.from_numpy(image)

rng = np.random.default_rng(0)
fnames = [f"{BREEDS[i % 4]}_{i}.jpg" for i in range(640)]
images = {fname: make_image(BREEDS.index(fname.split("_")[0]), rng) for fname in fnames}
print(len(fnames), "images, for example", fnames[0])'''

TUTORIAL_LABELS = '''def extract_label(fname):
    stem = fname.split(os.path.sep)[-1]
    return re.search(r"^(.*)_\\d+\\.jpg$", stem).groups()[0]

all_labels = [extract_label(fname) for fname in fnames]
id_to_label = sorted(set(all_labels))
label_to_id = {lbl: i for i, lbl in enumerate(id_to_label)}
extract_label(fnames[0]), label_to_id'''

TUTORIAL_DATASET = '''class PetsDataset(Dataset):
    def __init__(self, file_names, label_to_id=None, augment=False):
        self.file_names = file_names
        self.label_to_id = label_to_id
        self.augment = augment

    def __len__(self):
        return len(self.file_names)

    def __getitem__(self, idx):
        fname = self.file_names[idx]
        image = images[fname]
        if self.augment:  # fresh noise stands in for RandomResizedCrop
            image = image + 0.2 * torch.randn_like(image)
        label = extract_label(fname)
        if self.label_to_id is not None:
            label = self.label_to_id[label]
        return {"image": image, "label": label}


def get_dataloaders(batch_size: int = 32):
    "Builds a set of dataloaders with a batch_size"
    random_perm = np.random.default_rng(42).permutation(len(fnames))
    cut = int(0.8 * len(fnames))
    train_dataset = PetsDataset([fnames[i] for i in random_perm[:cut]], label_to_id, augment=True)
    eval_dataset = PetsDataset([fnames[i] for i in random_perm[cut:]], label_to_id)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=batch_size * 2)
    return train_dataloader, eval_dataloader'''

TUTORIAL_MODEL = '''def create_model(num_classes):
    "A small CNN standing in for the tutorial's pretrained resnet50d (no downloads)."
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4, num_classes),
    )


def training_loop(mixed_precision="no", seed: int = 42, batch_size: int = 32, epochs: int = 5):
    set_seed(seed)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    train_dataloader, eval_dataloader = get_dataloaders(batch_size)
    model = create_model(len(label_to_id))
    # Normalise with the training set's statistics, on the accelerator's device.
    mean = torch.tensor([0.03] * 3)[None, :, None, None].to(accelerator.device)
    std = torch.tensor([1.0] * 3)[None, :, None, None].to(accelerator.device)
    optimizer = torch.optim.Adam(params=model.parameters(), lr=3e-2 / 25)
    lr_scheduler = OneCycleLR(optimizer=optimizer, max_lr=3e-2, epochs=epochs,
                              steps_per_epoch=len(train_dataloader))
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    accelerator.print(f"{accelerator.num_processes} processes, {accelerator.distributed_type}")
    for epoch in range(epochs):
        model.train()
        for batch in train_dataloader:
            inputs = (batch["image"] - mean) / std
            loss = torch.nn.functional.cross_entropy(model(inputs), batch["label"])
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        model.eval()
        accurate = 0
        num_elems = 0
        for batch in eval_dataloader:
            inputs = (batch["image"] - mean) / std
            with torch.no_grad():
                predictions = model(inputs).argmax(dim=-1)
            accurate_preds = accelerator.gather(predictions) == accelerator.gather(batch["label"])
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()
        eval_metric = accurate.item() / num_elems
        accelerator.print(f"epoch {epoch}: {100 * eval_metric:.2f}")
    return eval_metric'''


def accelerate_tutorial():
    return [
        new_markdown_cell(
            "# Launching multi-process training from a Jupyter notebook\n\n"
            "Hugging Face's tutorial *Launching Multi-Node Training from a Jupyter Environment*, ported to "
            "`%%distributed`: fine-tune an image classifier with `Accelerator`, `prepare`, `OneCycleLR` and "
            "`gather` for distributed evaluation, on 2 processes.\n\n"
            "Differences from the original: no `write_basic_config()`/restart is needed (the ranks get the "
            "torchrun environment from the magic), and nothing is downloaded: the data set is synthetic and "
            "the model a small CNN defined here, so this runs in seconds on 2 CPU cores (gloo)."
        ),
        new_code_cell("%load_ext accel_magics"),
        new_markdown_cell("## Preparing the data set\n\nImages named like the Oxford pets files (`beagle_32.jpg`), "
                          "made in memory. Nothing here touches a GPU: all of it is shipped to the ranks."),
        new_code_cell(TUTORIAL_DATA),
        new_markdown_cell("The label is in the file name, as in the tutorial:"),
        new_code_cell(TUTORIAL_LABELS),
        new_code_cell(TUTORIAL_DATASET),
        new_markdown_cell("## The training function\n\nThe tutorial's `training_loop`, unchanged in shape: "
                          "seed, `Accelerator`, dataloaders, model, optimizer, `OneCycleLR`, `prepare`, "
                          "train, then distributed evaluation with `gather`; `accelerator.print` prints once, "
                          "on the main process."),
        new_code_cell(TUTORIAL_MODEL),
        new_markdown_cell("## Launching\n\nWhere the tutorial calls `notebook_launcher(training_loop, args, "
                          "num_processes=2)`, a cell does it. `--return final_accuracy` brings rank 0's result "
                          "back to the notebook."),
        new_code_cell("%%distributed --num_processes 2 --output text --return final_accuracy\n"
                      "final_accuracy = training_loop()"),
        new_code_cell("print(f\"final accuracy on the held-out images: {final_accuracy:.0%}\")\n"
                      "assert final_accuracy > 0.9, 'the model did not learn'"),
    ]


def failures_and_interrupts():
    return [
        new_markdown_cell(
            "# When things go wrong\n\n"
            "What a failing rank, a hang and a GPU already used by the kernel look like. Cells that are "
            "expected to fail carry the `raises-exception` tag."
        ),
        new_code_cell("%load_ext accel_magics"),
        new_markdown_cell(
            "## A rank fails\n\nRank 1 raises while rank 0 waits for it in a `barrier()`. The error names rank 1 "
            "and shows rank 1's own traceback; rank 0 is stopped. (Other launchers report rank 0's "
            "secondary *Connection closed by peer* instead.)"
        ),
        new_code_cell(
            "%%distributed --num_processes 2 --output text\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group(\"gloo\")\n"
            "print(\"step 1 done\")\n"
            "dist.barrier()\n"
            "if dist.get_rank() == 1:\n"
            "    raise ValueError(\"bad batch in rank 1\")\n"
            "dist.barrier()",
            metadata={"tags": ["raises-exception"]},
        ),
        new_markdown_cell("The next cell works: nothing of the failed run is left behind."),
        new_code_cell("%%distributed --num_processes 2 --output text\nimport os\nprint(\"rank\", os.environ[\"RANK\"], \"fine\")"),
        new_markdown_cell(
            "## A rank hangs\n\n`--timeout` stops the run and shows, for each rank, where it was: here rank 0 is "
            "stuck in its own function and rank 1 waits for it in `barrier()`. Without `--timeout`, the stop "
            "button (interrupt) stops every rank within seconds, with the same stacks, and raises "
            "`KeyboardInterrupt`."
        ),
        new_code_cell("import time\n\ndef load_shard():\n    time.sleep(3600)  # stands in for a stuck data loader"),
        new_code_cell(
            "%%distributed --num_processes 2 --output text --timeout 3\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group(\"gloo\")\n"
            "if dist.get_rank() == 0:\n"
            "    load_shard()\n"
            "dist.barrier()",
            metadata={"tags": ["raises-exception"]},
        ),
        new_markdown_cell(
            "## The kernel already holds a GPU\n\nIf CUDA (or XPU) was initialised in the kernel, `%%distributed` "
            "refuses to launch and says which cell did it. This machine has no GPU, so the next cell "
            "*simulates* an initialised CUDA runtime."
        ),
        new_code_cell("import torch\ntorch.cuda._initialized = True  # simulated: as if a tensor had been moved to a GPU\ntorch.cuda.init()"),
        new_code_cell("%%distributed --num_processes 2 --output text\nprint(\"never runs\")",
                      metadata={"tags": ["raises-exception"]}),
        new_code_cell("torch.cuda._initialized = False  # undo the simulation"),
    ]


def multi_node():
    return [
        new_markdown_cell(
            "# Several nodes, one Jupyter kernel each\n\n"
            "Run a Jupyter kernel on every node, then the same `%%distributed` cell on each, with the same "
            "`--num_nodes`, `--master_addr` (node 0's address) and `--master_port`, and each node's own "
            "`--node_rank`. Node 0 hosts the rendezvous. Ranks are numbered "
            "`RANK = node_rank * num_processes + local_rank`, `WORLD_SIZE = num_nodes * num_processes`."
        ),
        new_code_cell("%load_ext accel_magics"),
        new_markdown_cell(
            "## Choosing it once: the config form\n\n`%distributed_config` shows a form; every valid change "
            "becomes the default of later `%%distributed` cells (flags in a cell still win). It shows the "
            "equivalent command line, and refuses impossible values (a `node_rank` not below `num_nodes`, a port "
            "out of range, an address that does not resolve) as you type."
        ),
        new_code_cell("%distributed_config"),
        new_markdown_cell(
            "## The same, scripted\n\nHere on node 1, with node 0 at 10.1.2.3; node 0 runs the same line with "
            "`--node_rank 0` (each node prints the other nodes' lines):"
        ),
        new_code_cell("%distributed_config --num_processes 2 --num_nodes 2 --node_rank 1 --master_addr 10.1.2.3 --master_port 29500"),
        new_markdown_cell(
            "With those defaults, a plain `%%distributed` cell joins the 4-rank world. Check on every node: the "
            "same port is open on node 0 (firewall), node 0's cell is started, all nodes use the same "
            "`num_processes`. Bad combinations are refused before anything starts: a `node_rank` not below "
            "`num_nodes`, and node 0 on a machine that does not have node 0's address (here: this machine is "
            "not 10.1.2.3):"
        ),
        new_code_cell("%distributed_config --node_rank 2", metadata={"tags": ["raises-exception"]}),
        new_code_cell("%distributed_config --node_rank 0", metadata={"tags": ["raises-exception"]}),
        new_code_cell("%distributed_config --reset"),
    ]


SESSION_DATA = '''import torch

def make_data(n, seed):
    """Two classes in 8 dimensions, synthetic (no downloads)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return torch.utils.data.TensorDataset(x, y)'''

SESSION_BUILD = '''%%distributed --session --output text
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

accelerator = Accelerator()
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
train = torch.utils.data.DataLoader(make_data(512, seed=0), batch_size=32, shuffle=True)
test = torch.utils.data.DataLoader(make_data(256, seed=1), batch_size=64)
model, optimizer, train, test = accelerator.prepare(model, optimizer, train, test)

def evaluate():
    model.eval()
    right = total = 0
    with torch.no_grad():
        for x, y in test:
            pred, y = accelerator.gather_for_metrics((model(x).argmax(-1), y))
            right += (pred == y).sum().item()
            total += len(y)
    model.train()
    return right / total

def train_epoch():
    for x, y in train:
        optimizer.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()

accelerator.print(f"{accelerator.num_processes} processes, {accelerator.distributed_type}")
accelerator.print(f"before training: accuracy {evaluate():.2f}")'''


def sessions():
    return [
        new_markdown_cell(
            "# Sessions: ranks that keep their state across cells\n\n"
            "`%distributed_session start` starts persistent ranks; `%%distributed --session` cells run on them, "
            "and what one cell builds (the model, the optimizer, `Accelerator()`) is there in the next."
        ),
        new_code_cell("%load_ext accel_magics"),
        new_code_cell("%distributed_session start -n 2"),
        new_markdown_cell("The data comes from the notebook, as for any cell."),
        new_code_cell(SESSION_DATA),
        new_markdown_cell("Build once: the model, its optimizer and the data loaders, prepared by Accelerate."),
        new_code_cell(SESSION_BUILD),
        new_markdown_cell("Train an epoch, look, train on: the same model each time."),
        new_code_cell("%%distributed --session --output text\ntrain_epoch()\n"
                      "accelerator.print(f\"after epoch 1: accuracy {evaluate():.2f}\")"),
        new_code_cell("%%distributed --session --output text --return acc\n"
                      "for group in optimizer.param_groups:\n    group[\"lr\"] = 0.1\n"
                      "train_epoch()\nacc = evaluate()\naccelerator.print(f\"after epoch 2: accuracy {acc:.2f}\")"),
        new_code_cell("round(acc, 2)"),
        new_markdown_cell(
            "A rank that raises fails the cell with its own traceback; every rank is back at its prompt, so "
            "the session and its state live on."
        ),
        new_code_cell("%%distributed --session --output text\nif accelerator.process_index == 1:\n"
                      "    raise ValueError(\"a bad batch on rank 1\")",
                      metadata={"tags": ["raises-exception"]}),
        new_code_cell("%%distributed --session --output text\n"
                      "accelerator.print(f\"still trained: accuracy {evaluate():.2f}\")"),
        new_markdown_cell(
            "`%distributed_session stop` ends the ranks and frees their memory (GPU memory included)."
        ),
        new_code_cell("%distributed_session stop"),
    ]


def multi_node_slurm():
    return [
        new_markdown_cell(
            "# Several nodes from one notebook: a Slurm allocation\n\n"
            "This kernel runs inside a Slurm allocation of 2 nodes (`salloc -N 2`, then Jupyter). "
            "`--launcher slurm` runs the cell on every node of it: one world, all ranks in one view. "
            "(Executed under nbval by tests/test_slurm.py, inside an allocation of its two-node test cluster; "
            "the default test run ignores it.)"
        ),
        new_code_cell("%load_ext accel_magics"),
        new_code_cell("%distributed_config --launcher slurm"),
        new_code_cell(
            "%%distributed --num_processes 2 --output text --return total\n"
            "import os, torch, torch.distributed as dist\n"
            "dist.init_process_group(\"gloo\")\n"
            "rank = dist.get_rank()\n"
            "total = torch.tensor([rank + 1.0])\n"
            "dist.all_reduce(total)\n"
            "print(f\"rank {rank} of {dist.get_world_size()} on {os.environ['SLURMD_NODENAME']}: "
            "sum = {total.item():g}\")\n"
            "dist.destroy_process_group()"
        ),
        new_code_cell("total"),
        new_markdown_cell("A rank failing on the second node is named with its node; nothing hangs."),
        new_code_cell(
            "%%distributed --num_processes 2 --output text\n"
            "import torch.distributed as dist\n"
            "dist.init_process_group(\"gloo\")\n"
            "dist.barrier()   # every rank set up before one fails (see join_wait in docs/reference/hooks.md)\n"
            "if dist.get_rank() == 3:\n"
            "    raise ValueError(\"bad shard on rank 3\")\n"
            "dist.barrier()",
            metadata={"tags": ["raises-exception"]},
        ),
        new_code_cell("%distributed_config --reset"),
    ]


NOTEBOOKS = {
    "quickstart.ipynb": quickstart,
    "accelerate_tutorial.ipynb": accelerate_tutorial,
    "failures_and_interrupts.ipynb": failures_and_interrupts,
    "multi_node.ipynb": multi_node,
    "sessions.ipynb": sessions,
    # Needs a Slurm allocation (tests/test_slurm.py regenerates and runs it inside one).
    "multi_node_slurm.ipynb": multi_node_slurm,
}



def main() -> None:
    execute = "--execute" in sys.argv
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name, cells in NOTEBOOKS.items():
        if only and name not in only:
            continue
        if name == "multi_node_slurm.ipynb" and execute and not os.environ.get("SLURM_JOB_ID"):
            print("skipped", name, "(run it inside a Slurm allocation)")
            continue
        nb = new_notebook(cells=cells())
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = os.path.join(HERE, name)
        if execute:
            from nbconvert.preprocessors import ExecutePreprocessor
            ExecutePreprocessor(timeout=600, kernel_name="python3", allow_errors=True).preprocess(
                nb, {"metadata": {"path": HERE}})
        nbformat.write(nb, path)
        print("wrote", path)


if __name__ == "__main__":
    main()
