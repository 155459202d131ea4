"""keep_freed_memory: an expert's training steps reuse freed memory instead of page-faulting it in again."""
from __future__ import annotations

import subprocess
import sys

import pytest

# Two h=1024 ffn experts take forward+backward+Adam steps on a thread, as the server's runtime does; prints the
# minor page faults of a typical step once warmed up. Their gradients (16 MiB each) are freed and re-allocated
# every step.
SCRIPT = """
import resource, sys, threading, torch
import dmoe.allocator
if sys.argv[1] == "tuned":
    assert dmoe.allocator.keep_freed_memory()
from dmoe.server import ExpertBackend, create_expert
from dmoe.server.layers import expert_class
torch.set_num_threads(1)
backends = []
for i in range(2):
    module = create_expert("ffn", 1024, seed=i)
    backends.append(ExpertBackend(f"e.{i}", module, expert_class("ffn").sample(2, 1024),
                                  torch.optim.Adam(module.parameters(), lr=1e-4)))
def step():
    for backend in backends:
        x = torch.randn(32, 1024)
        backend.backward(x, backend.forward(x)[0])
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def work():
    step(); step()
    counts = []
    for _ in range(5):
        before = faults()
        step()
        counts.append(faults() - before)
    print(sorted(counts)[2])  # the median step: the heap may still grow once (one 16 MiB block, ~4,100 faults)
thread = threading.Thread(target=work)
thread.start()
thread.join()
"""


def faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_training_steps_on_a_thread_stop_page_faulting_with_keep_freed_memory():
    default, tuned = faults_per_step("default"), faults_per_step("tuned")
    # a gradient of 16 MiB is 4,096 pages: by default each step faults several of them in again
    assert default > 4096
    assert tuned < default / 10
