"""RemoteExpert against a real dmoe-server process: same outputs and gradients as the local module, training."""
from __future__ import annotations

import logging
import socket
import threading

import grpc
import pytest
import torch

from dmoe.client import (
    RemoteExpert,
    RemoteExpertError,
    backward_future,
    backward_futures,
    expert_info,
    forward_future,
    forward_futures,
    new_activation_id,
)
from dmoe.experts import create_expert, expert_seed
from dmoe.wire import ChannelPool
from tests.procs import running

HIDDEN = 16
LR = 0.1


@pytest.fixture(scope="module")
def server():
    with running("-m", "dmoe.cli.server", "--experts", "ffn.[0:12]", "--expert-cls", "ffn",
                 "--hidden-dim", str(HIDDEN), "--optimizer", "sgd", "--lr", str(LR), "--seed", "7",
                 "--max-batch-size", "65536", "--torch-threads", "1") as proc:
        yield proc.endpoint()


def local_copy(uid: str) -> torch.nn.Module:
    return create_expert("ffn", HIDDEN, seed=expert_seed(7, uid))


def test_remote_forward_equals_local_module_with_same_weights(server):
    x = torch.randn(5, HIDDEN)
    remote = RemoteExpert("ffn.0", server)(x)
    assert remote.shape == (5, HIDDEN)
    torch.testing.assert_close(remote, local_copy("ffn.0")(x).detach())


def test_remote_backward_matches_local_autograd_and_applies_the_optimizer(server):
    local = local_copy("ffn.1")
    x = torch.randn(6, HIDDEN)
    weights = torch.randn(6, HIDDEN)

    x_remote = x.clone().requires_grad_()
    expert = RemoteExpert("ffn.1", server)
    before = expert(x_remote)
    (before * weights).sum().backward()

    x_local = x.clone().requires_grad_()
    (local(x_local) * weights).sum().backward()
    torch.testing.assert_close(x_remote.grad, x_local.grad)

    # the server took one SGD step with the same gradient: replaying it locally predicts the new outputs
    torch.optim.SGD(local.parameters(), lr=LR).step()
    after = expert(x).detach()
    assert not torch.allclose(after, before.detach(), atol=1e-4)
    torch.testing.assert_close(after, local(x).detach())


def test_sixteen_threads_fifty_calls_each_all_correct(server):
    local = local_copy("ffn.2")
    inputs = [[torch.randn(1 + (t + i) % 7, HIDDEN) for i in range(50)] for t in range(16)]
    results: list[list[torch.Tensor | None]] = [[None] * 50 for _ in range(16)]
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            for i, x in enumerate(inputs[t]):
                results[t][i] = forward_future(server, "ffn.2", [x], timeout=60).result()[0]
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "clients deadlocked"
    assert not errors, errors[:3]
    with torch.no_grad():
        for t in range(16):
            for i in range(50):
                torch.testing.assert_close(results[t][i], local(inputs[t][i]))


def test_concurrent_calls_to_several_experts_resolve_independently(server):
    xs = {uid: torch.randn(3, HIDDEN) for uid in ("ffn.0", "ffn.3", "ffn.4")}
    futures = {uid: forward_future(server, uid, [x]) for uid, x in xs.items()}
    with torch.no_grad():
        for uid, future in futures.items():
            torch.testing.assert_close(future.result(timeout=60)[0], local_copy(uid)(xs[uid]))


def test_payloads_over_the_unary_limit_are_streamed_in_parts(server):
    # 40000 x 16 float32 = 2.5 MB: more than one streamed part each way
    x = torch.randn(40_000, HIDDEN)
    grad = torch.randn(40_000, HIDDEN)
    local = local_copy("ffn.5")
    output = forward_future(server, "ffn.5", [x], unary_limit=1024).result(timeout=60)[0]
    with torch.no_grad():
        torch.testing.assert_close(output, local(x))
    x_local = x.clone().requires_grad_()
    local(x_local).backward(grad)
    grad_x = backward_future(server, "ffn.5", [x], [grad], unary_limit=1024).result(timeout=60)[0]
    torch.testing.assert_close(grad_x, x_local.grad)


def test_batched_calls_answer_each_expert_as_its_own_call_would(server):
    # one call for the server (two with a small unary_limit, plus the item too large for one message, streamed)
    xs = [torch.randn(n, HIDDEN) for n in (3, 5, 1, 300)]
    uids = ["ffn.0", "ffn.3", "ffn.99", "ffn.4"]
    for limit in (None, 2048):
        futures = forward_futures([(uid, server, [x], None) for uid, x in zip(uids, xs)], timeout=60,
                                  **({"unary_limit": limit} if limit else {}))
        with torch.no_grad():
            for i in (0, 1, 3):
                torch.testing.assert_close(futures[i].result(timeout=60)[0], local_copy(uids[i])(xs[i]))
        with pytest.raises(RemoteExpertError) as error:
            futures[2].result(timeout=60)
        assert error.value.code == grpc.StatusCode.NOT_FOUND and "ffn.99" in str(error.value)


def test_batched_backward_resends_the_inputs_of_experts_whose_server_no_longer_holds_them(server):
    # ffn.7 ran its forward under this id, so the server holds its inputs; ffn.8's id was never sent (as if
    # evicted): FAILED_PRECONDITION, then sent again with the inputs. Both give autograd's gradients and step.
    x, grad = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    kept = new_activation_id()
    forward_futures([("ffn.7", server, [x], kept)], timeout=60)[0].result(timeout=60)
    before = {uid: expert_info(server, uid)["backward_calls"] for uid in ("ffn.7", "ffn.8")}
    items = [("ffn.7", server, [x], [grad], kept), ("ffn.8", server, [x], [grad], new_activation_id())]
    grads = backward_futures(items, timeout=60)
    for uid, future in zip(("ffn.7", "ffn.8"), grads):
        x_local = x.clone().requires_grad_()
        local_copy(uid)(x_local).backward(grad)
        torch.testing.assert_close(future.result(timeout=60)[0], x_local.grad)
        assert expert_info(server, uid)["backward_calls"] == before[uid] + 1


def test_batched_calls_to_a_dead_server_fail_every_item_unavailable():
    with socket.socket() as bound:  # bound, never listening, for the whole test: connections are refused, and no
        bound.bind(("127.0.0.1", 0))  # other test's server can take the port meanwhile (review 54)
        endpoint = f"127.0.0.1:{bound.getsockname()[1]}"
        futures = forward_futures([(f"ffn.{i}", endpoint, [torch.randn(2, HIDDEN)], None) for i in range(3)],
                                  timeout=10)
        for future in futures:
            with pytest.raises(RemoteExpertError) as error:
                future.result(timeout=60)
            assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_info_reports_schema_and_counts_one_request_per_call(server):
    before = expert_info(server, "ffn.6")
    assert before["inputs"] == [((HIDDEN,), "float32")] and before["outputs"] == [((HIDDEN,), "float32")]
    assert before["expert_cls"] == "ffn" and before["hparams"]["lr"] == LR
    x = torch.randn(2, HIDDEN)
    for _ in range(3):
        forward_future(server, "ffn.6", [x]).result(timeout=60)
    backward_future(server, "ffn.6", [x], [x]).result(timeout=60)
    after = expert_info(server, "ffn.6")
    assert after["forward_calls"] - before["forward_calls"] == 3
    assert after["backward_calls"] - before["backward_calls"] == 1


def test_compressed_responses_stay_close_to_exact(server):
    x = torch.randn(8, HIDDEN)
    exact = forward_future(server, "ffn.0", [x]).result(timeout=60)[0]
    for compression, tolerance in (("float16", 1e-2), ("uint8", 0.1)):
        approx = forward_future(server, "ffn.0", [x], compression=compression).result(timeout=60)[0]
        assert approx.dtype == torch.float32
        assert (approx - exact).abs().max() < tolerance


def test_timeout_and_unknown_expert_raise_remote_expert_error(server):
    # a hung server: the TCP connection is accepted (backlog) but nothing ever answers
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        endpoint = f"127.0.0.1:{hung.getsockname()[1]}"
        with pytest.raises(RemoteExpertError) as error:
            forward_future(endpoint, "ffn.0", [torch.randn(2, HIDDEN)], timeout=0.5).result(timeout=60)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(RemoteExpertError) as error:
        RemoteExpert("ffn.99", server)(torch.randn(2, HIDDEN))
    assert error.value.code == grpc.StatusCode.NOT_FOUND and "ffn.99" in str(error.value)


def test_private_channel_pool_is_used_and_closable(server):
    with ChannelPool() as channels:
        x = torch.randn(2, HIDDEN)
        out = RemoteExpert("ffn.0", server, channels=channels)(x)
        torch.testing.assert_close(out, local_copy("ffn.0")(x).detach())


def test_float16_compression_of_inputs_beyond_its_range_is_answered_not_refused_as_non_finite(server):
    """float16 cast finite inputs above 65504 to inf, and the server (which refuses non-finite inputs) failed the
    call; the values now saturate, and the expert answers as for inputs at 65504."""
    x = torch.full((3, HIDDEN), 1e5)
    outputs = forward_future(server, "ffn.8", [x], timeout=30, compression="float16").result()
    expected = forward_future(server, "ffn.8", [torch.full((3, HIDDEN), 65504.0)], timeout=30).result()
    torch.testing.assert_close(outputs[0], expected[0], rtol=1e-2, atol=1e-2)


def test_a_non_finite_output_gradient_is_not_sent_and_makes_the_input_gradient_nan(server, caplog):
    """As a local module under an AMP overflow: the input gradient is NaN (GradScaler skips the step), not an
    INVALID_ARGUMENT error from the server, which never sees the gradient."""
    before = expert_info(server, "ffn.4")["backward_calls"]
    x = torch.randn(4, HIDDEN, requires_grad=True)
    out = RemoteExpert("ffn.4", server, timeout=30)(x)
    grad = torch.ones_like(out)
    grad[1, 2] = float("inf")
    caplog.set_level(logging.WARNING, logger="dmoe.client.remote_expert")
    out.backward(grad)
    assert torch.isnan(x.grad).all()
    assert "non-finite" in caplog.text and "not sent" in caplog.text
    assert expert_info(server, "ffn.4")["backward_calls"] == before


def test_a_remote_expert_given_the_grad_scaler_steps_on_unscaled_gradients(server):
    """Under AMP the gradient reaching the expert is the loss scale times the true one, and the server steps on it
    at once: given the scaler, the expert sends it unscaled (its SGD step is the local copy's) and returns the input
    gradient scaled, as the scaler expects."""
    uid, scale = "ffn.9", 1024.0
    local = local_copy(uid)
    sgd = torch.optim.SGD(local.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    remote = RemoteExpert(uid, server, timeout=30, grad_scaler=scaler)
    x = torch.randn(4, HIDDEN, requires_grad=True)
    scaler.scale(remote(x).pow(2).sum()).backward()
    x_local = x.detach().clone().requires_grad_()
    local(x_local).pow(2).sum().backward()
    sgd.step()
    torch.testing.assert_close(x.grad / scale, x_local.grad)
    probe = torch.randn(3, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(remote(probe), local(probe))  # the server stepped as the local copy did


def test_a_remote_expert_on_data_that_requires_no_grad_still_trains_its_weights(server):
    """Review 46: as the first module (data straight in) its output had no grad_fn, so backward raised and the
    remote weights could never train."""
    x, weights = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    expert = RemoteExpert("ffn.10", server)
    output = expert(x)
    assert output.requires_grad
    (output * weights).sum().backward()
    local = local_copy("ffn.10")
    (local(x) * weights).sum().backward()
    torch.optim.SGD(local.parameters(), lr=LR).step()
    with torch.no_grad():
        torch.testing.assert_close(expert(x), local(x))


class _Scaler:
    """What a ``torch.amp.GradScaler`` shows the layer: enabled, and its scale."""

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return 65536.0


def test_float16_inputs_under_a_grad_scaler_get_their_scaled_gradients_not_zeros(server):
    """Review 46: the experts' unscaled input gradients were cast to float16 before the scale was put back, and
    underflowed to zero; the scaled gradients fit float16, which is what loss scaling is for."""
    import numpy as np

    from dmoe.client.failures import CallPolicy
    from dmoe.client.moe import PlannedCall, _RemoteExperts

    grads = {}
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
        policy = CallPolicy(grad_scaler=_Scaler(), backward_k_min=1)
        plan = [PlannedCall("ffn.11", server, np.arange(4), np.zeros(4, dtype=np.int64))]
        out, _ = _RemoteExperts.apply(torch.empty(0, requires_grad=True), x, policy, plan, 1, True)
        # the scaled gradient AMP delivers: about 6.5e-5, which float16 holds (unscaled, about 1e-9, it does not)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).mul(1e-9 * 65536).to(dtype))
        grads[dtype] = x.grad.float()
    assert grads[torch.float16].abs().min() > 0
    torch.testing.assert_close(grads[torch.float16], grads[torch.float32], rtol=2e-3, atol=1e-7)
