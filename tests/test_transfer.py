"""The runtime's copies between host and device (dmoe/server/transfer.py) on a CPU; the GPU path (pinned memory,
a copy stream per worker) is checked on real hardware in tests/test_cuda.py."""
from __future__ import annotations

import torch

from dmoe.server.runtime import Runtime
from dmoe.server.transfer import CudaTransfers, Transfers, make_transfers


def test_a_cpu_worker_gets_plain_transfers_whatever_overlap_says():
    for overlap in (True, False):
        transfers = make_transfers(torch.device("cpu"), overlap)
        assert type(transfers) is Transfers and not isinstance(transfers, CudaTransfers)


def test_inputs_join_each_tensor_of_the_requests_along_rows_in_order():
    requests = [(torch.randn(3, 4), torch.randn(3, 2)), (torch.randn(1, 4), torch.randn(1, 2)),
                (torch.randn(5, 4), torch.randn(5, 2))]
    joined = Transfers(torch.device("cpu")).inputs(requests)
    assert len(joined) == 2
    torch.testing.assert_close(joined[0], torch.cat([r[0] for r in requests]))
    torch.testing.assert_close(joined[1], torch.cat([r[1] for r in requests]))


def test_a_lone_request_is_not_copied_and_outputs_come_back_detached():
    x = torch.randn(4, 3)
    (same,) = Transfers(torch.device("cpu")).inputs([(x,)])
    assert same.data_ptr() == x.data_ptr()
    w = torch.randn(3, 3, requires_grad=True)
    (out,) = Transfers(torch.device("cpu")).outputs([x @ w])
    assert not out.requires_grad and out.grad_fn is None and out.device.type == "cpu"
    torch.testing.assert_close(out, (x @ w).detach())


def test_a_runtime_without_overlapped_copies_computes_the_same_batches():
    xs = [torch.randn(n, 3) for n in (2, 5, 1)]
    results = {}
    for overlap in (True, False):
        with Runtime(workers=2, overlap_copies=overlap) as runtime:
            pool = runtime.create_pool("square", lambda x: (x * x,), max_batch_size=16)
            futures = [runtime.submit(pool, x) for x in xs]
            results[overlap] = [f.result(30)[0] for f in futures]
    for x, a, b in zip(xs, results[True], results[False]):
        torch.testing.assert_close(a, x * x)
        torch.testing.assert_close(b, x * x)
