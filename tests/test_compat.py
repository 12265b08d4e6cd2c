"""Compatibility: real third-party code in %%distributed cells, compared with
the same code under torchrun on this machine (issue 14).

Each case runs one script twice, as a torchrun job and as a cell (2 ranks,
gloo on CPU), and compares what every rank printed, line for line.  The
environment both get is the same: ``ACCELERATE_USE_CPU=true`` (what the cell
sets on a CPU-only machine) and one thread per rank.  Marked ``compat``: run
alone with ``pytest -m compat``; CI installs the packages (``.[compat]``).
"""
from __future__ import annotations

import collections
import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.compat, pytest.mark.timeout(600)]

COMMON_ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
# A rank's stderr goes where its stdout goes, as in a cell (one stream per rank,
# in order); the same first line in both runs.
MERGE_STDERR = "import os as _os; _os.dup2(1, 2)\n"
_C10_TIME = re.compile(r"\[([WIE])\d{4} \d\d:\d\d:\d\d\.\d+ ")


_WARNING = re.compile(r"[Ww]arning|warnings\.warn|^\s+warn")


def normalised(lines: list[str]) -> list[str]:
    """What the code printed, without what differs between any two runs:
    timestamps, timings, and warnings (a library warns once per process, and a
    module the launcher preloaded warned at import in the launcher, not in the
    rank)."""
    out = []
    for line in lines:
        if _WARNING.search(line):
            continue
        line = _C10_TIME.sub(r"[\1<time> ", line)
        if "train_runtime" in line:
            line = "<the Trainer's timings>"
        out.append(line)
    return out


# How a reference process ends once its script has run: as a cell's rank ends
# (os._exit after flushing), not through interpreter finalisation, where torch
# can abort a process whose script is done: gloo's C++ threads outlive the
# interpreter ("terminate called without an active exception", SIGABRT;
# measured here 0-2 times in 10-20 runs of a case, and once on CI, in the FSDP2
# case, though it calls destroy_process_group()).  Nothing the code under test
# prints is lost (the cell's ranks skip finalisation too), and a rank that fails
# in its script still fails the reference.
END_LIKE_A_RANK = "\nimport os as _os, sys as _sys\n_sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)\n"


def torchrun(script: str, tmp_path, nproc: int = 2) -> dict[int, list[str]]:
    """What each rank printed (stdout) under torchrun; asserts it succeeded."""
    tmp_path = tmp_path / "torchrun"
    tmp_path.mkdir()
    path = tmp_path / "script.py"
    path.write_text(MERGE_STDERR + script + END_LIKE_A_RANK)
    # torch elastic's agent makes a log directory (torchelastic_*) in the temp
    # dir and keeps it: the test's own, not the user's.
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, **COMMON_ENV, "TMPDIR": str(tmp_path / "tmp")}
    with socket.socket() as probe:   # not torchrun's fixed 29500: another job on the machine may hold it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                           "--master_port", str(port), "--tee", "1", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=400)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return _by_rank(proc.stdout, r"\[default(\d+)\]:(.*)$")


def _by_rank(text: str, tagged: str) -> dict[int, list[str]]:
    """Each rank's lines, from output whose lines the regex ``tagged`` splits into (rank, text)."""
    ranks = collections.defaultdict(list)
    for line in text.splitlines():
        m = re.match(tagged, line)
        if m:
            ranks[int(m.group(1))].append(m.group(2))
    return dict(ranks)


@pytest.fixture(scope="module")
def kernel():
    """The module's kernel, started with COMMON_ENV: OMP_NUM_THREADS is read as
    torch loads, so setting it in the kernel per test would start a fresh
    launcher each time (as it must: a rank is a new process)."""
    from conftest import LoadedKernel

    k = LoadedKernel(extra_env=COMMON_ENV)
    try:
        yield k
    finally:
        k.shutdown()


def in_cell(kernel, script: str, tmp_path, nproc: int = 2, setup: str = "") -> dict[int, list[str]]:
    """What each rank printed in a %%distributed cell; asserts it succeeded."""
    tmp_path = tmp_path / "cell"
    tmp_path.mkdir()
    kernel.ok(f"import os\nos.chdir({str(tmp_path)!r})\n")
    try:
        if setup:
            kernel.ok(setup)
        res = kernel.run(f"%%distributed -n {nproc} --output text\n{MERGE_STDERR}{script}", timeout=400)
    finally:
        kernel.ok("os.chdir(os.path.expanduser('~'))\n")
    assert res.status == "ok", res.error_text
    return _by_rank(res.stdout, r"\[rank (\d+)\] ?(.*)$")


def assert_same(cell: dict, reference: dict, must_contain: str) -> None:
    assert sorted(cell) == sorted(reference), (cell, reference)
    for rank in reference:
        assert normalised(cell[rank]) == normalised(reference[rank]), f"rank {rank} differs:\ncell: {cell[rank]}\ntorchrun: {reference[rank]}"
    assert any(must_contain in line for lines in reference.values() for line in lines), reference


@pytest.mark.parametrize("name,marker", [
    ("test_ops", "testing gather"),
    ("test_sync", "**Test Distributed `no_sync` context manager**"),
    ("test_script", "**DataLoader integration test**"),
])
def test_accelerates_own_test_scripts(clean_kernel, tmp_path, name, marker):
    """Accelerate's shipped test scripts (those that run on CPU), as `accelerate test` runs them."""
    pytest.importorskip("accelerate.test_utils.scripts", reason="accelerate's test scripts are not installed")
    # PartialState(cpu=True) first: on CPU a bare PartialState() (test_ops) is one
    # process under torchrun as in a cell (README: Accelerate on CPU).
    script = f"from accelerate import PartialState\nPartialState(cpu=True)\n" \
             f"from accelerate.test_utils.scripts import {name}\n{name}.main()\n"
    assert_same(in_cell(clean_kernel, script, tmp_path), torchrun(script, tmp_path), marker)


TRAINER = '''
import torch
from torch.utils.data import Dataset

class Synthetic(Dataset):
    """Token ids and labels from a fixed seed: no download."""
    def __init__(self, n=64, length=16, vocab=100):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.labels = (self.ids.sum(1) % 2)
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}

def train(out):
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=out, max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3,
                             seed=0, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             logging_strategy="no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Synthetic())
    result = trainer.train()
    total = sum(p.detach().double().sum().item() for p in model.parameters())
    print("trainer", args.world_size, args.process_index, trainer.state.global_step,
          f"{result.training_loss:.6f}", f"{total:.6f}")
'''


def test_transformers_trainer_on_a_tiny_model(clean_kernel, tmp_path):
    """transformers Trainer, a tiny BERT built from a config; the notebook pattern:
    definitions in one cell, the cell calls train()."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[compat]')")
    reference = torchrun(TRAINER + "train('out')\n", tmp_path)
    assert_same(in_cell(clean_kernel, "train('out')\n", tmp_path, setup=TRAINER), reference, "trainer 2 ")


FABRIC = '''
import torch
import lightning as L

fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
fabric.seed_everything(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
g = torch.Generator().manual_seed(fabric.global_rank)
for step in range(5):
    x = torch.randn(16, 8, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
total = fabric.all_reduce(loss.detach(), reduce_op="sum")
print("fabric", fabric.world_size, fabric.global_rank, f"{total.item():.6f}",
      f"{sum(p.sum().item() for p in model.parameters()):.6f}")
'''


def test_lightning_fabric_joins_the_torchrun_environment(clean_kernel, tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (pip install '.[compat]')")
    assert_same(in_cell(clean_kernel, FABRIC, tmp_path), torchrun(FABRIC, tmp_path), "fabric 2 ")


FSDP2_DCP = '''
import os
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank = dist.get_rank()

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    return fully_shard(model)

model = make()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
for step in range(4):
    x = torch.randn(8, 16, generator=g)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dcp.save({"model": get_model_state_dict(model)}, checkpoint_id="ckpt")
fresh = make()
state = {"model": get_model_state_dict(fresh)}
dcp.load(state, checkpoint_id="ckpt")
set_model_state_dict(fresh, state["model"])
def checksum(m):
    return sum(p.full_tensor().double().sum().item() for p in m.parameters())
print("fsdp2", dist.get_world_size(), rank, f"{loss.item():.6f}", f"{checksum(model):.6f}", f"{checksum(fresh):.6f}",
      sorted(os.listdir("ckpt"))[:1])
dist.destroy_process_group()
'''


def test_fsdp2_with_distributed_checkpoint(clean_kernel, tmp_path):
    reference = torchrun(FSDP2_DCP, tmp_path)
    for line in reference[0]:
        if line.startswith("fsdp2"):
            parts = line.split()
            assert parts[4] == parts[5], "the checkpoint did not round-trip under torchrun"
    assert_same(in_cell(clean_kernel, FSDP2_DCP, tmp_path), reference, "fsdp2 2 ")
