"""Weight sync to several servers (`ServerRoster`, the backends' fan-out and `rejoin`): every server gets every
version, one that stops answering is left out while the others go on, and one that comes back as a new process
is rejoined and sent every weight. Disk against the real CPU server, NCCL and LoRA against stub workers.

The real-server test puts two `LabelledProxy`s in front of the session's one server (a second real server
costs a minute of start-up; the trainer's tests kill and restart real ones): each has its own port and its
own weight label (`/weight_info`, `/update_weight_version`, which is how a restarted process shows), can stop
accepting connections, and come back on the same port labelled `default`. Reloads and generation go to the
real server, so what it serves after each sync is checked with its own log-probs.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest
import torch

from agrpo_sync import ServerUnreachableError, WeightSync, WeightSyncConfig, adapter_name
from agrpo_sync._server_roster import each_server
from tools.bench.weight_sync.gloo_transport import GlooTransport
from tools.bench.weight_sync.stub_worker import ROUTES, StubWorker, checksums
from tools.loopback_http import LoopbackHTTP


class LabelledProxy:
    """Forwards to the real server, but keeps its own weight label; `down()`, then `up()` on the same port."""

    def __init__(self, target: str) -> None:
        self.target, self.label, self.port = target, "default", 0
        self.client = httpx.Client(timeout=600)
        self.server: LoopbackHTTP | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path == "/weight_info":
            return 200, json.dumps({"weight_version": self.label}).encode()
        if path == "/update_weight_version":
            self.label = json.loads(body)["new_version"]
            return 200, b'{"success": true}'
        headers = {"content-type": "application/json"} if body else {}
        response = self.client.request(method, self.target + path, content=body, headers=headers)
        return response.status_code, response.content

    def up(self, label: str = "default") -> LabelledProxy:
        self.label = label
        self.server = LoopbackHTTP(self._answer, self.port)
        self.port = self.server.port
        return self

    def down(self) -> None:
        """Its process is gone: the port refuses connections, and kept-alive ones are closed."""
        self.server.stop()


def test_each_server_reports_the_unreachable_and_raises_the_first_other_error():
    seen = []

    def call(index: int) -> None:
        seen.append(index)
        if index == 1:
            raise ServerUnreachableError("GET /x", None, "refused")
        if index == 2:
            raise ValueError("answered 500")

    assert each_server(call, [0, 1]) == {1}
    with pytest.raises(ValueError, match="answered 500"):
        each_server(call, [0, 1, 2, 3])
    assert sorted(seen) == [0, 0, 1, 1, 2, 3], "every call ran before the error was raised"


@pytest.mark.server
@pytest.mark.usefixtures("restore_server")
def test_disk_sync_reaches_every_server_leaves_out_a_dead_one_and_rejoins_it_restarted(
    vllm_server, tmp_path, tiny_model, perturb, logprobs, caplog
):
    a, b = LabelledProxy(vllm_server.url).up(), LabelledProxy(vllm_server.url).up()
    model = tiny_model()
    config = WeightSyncConfig(base_url=[a.url, b.url], output_dir=str(tmp_path), backend="disk")
    sync = WeightSync.start(config, model)
    try:
        perturb(model, 1)
        sync.sync(model, 1)
        assert (a.label, b.label, sync.members) == ("1", "1", {0, 1})
        b.down()
        perturb(model, 2)
        with caplog.at_level(logging.WARNING, logger="agrpo_sync"):
            sync.sync(model, 2)  # goes on without B
        assert (a.label, sync.members) == ("2", {0}) and "does not answer" in caplog.text
        assert sync.needs_resync(1) is False, "nothing to send a server that does not answer"
        b.up()  # a new process on the same port, on its start-up weights
        assert sync.needs_resync(1) is True and sync.needs_resync(0) is False
        perturb(model, 3)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="agrpo_sync"):
            sync.sync(model, 3)
        assert "answers weight label 'default' where this trainer set '1'" in caplog.text
        assert (a.label, b.label, sync.members) == ("3", "3", {0, 1})
        torch.testing.assert_close(
            logprobs.server(vllm_server.model_name), logprobs.trainer(model), atol=1e-4, rtol=0
        )
        assert sorted(p.name for p in (tmp_path / ".vllm_weights").iterdir()) == ["v3"], (
            "written once per version"
        )
    finally:
        sync.close()
        a.down()
        b.down()


def _stub(port: int = 0, **kwargs) -> StubWorker:
    worker = StubWorker(transport=GlooTransport(timeout_s=20), dtype="float32", **kwargs)
    worker.http = worker.serve(port)
    worker.url = worker.http.url
    return worker


def _restart(worker: StubWorker, **kwargs) -> StubWorker:
    """The same port, a new process: no weights, no group, no adapters, label `default`."""
    worker.http.stop()
    return _stub(worker.http.port, **kwargs)


@pytest.fixture
def labelled_stubs(monkeypatch):
    """vLLM's `/update_weight_version` on the stub workers (LoRA labels servers with it)."""
    route = lambda w, q, b: w.state.update(version=b["new_version"]) or {"success": True}  # noqa: E731
    monkeypatch.setitem(ROUTES, ("POST", "/update_weight_version"), route)


def test_nccl_sync_goes_to_each_server_in_its_own_group_and_a_restarted_one_joins_a_new_one(
    tmp_path, tiny_model, perturb
):
    a, b = _stub(), _stub()
    model = tiny_model()
    config = WeightSyncConfig(
        base_url=[a.url, b.url], output_dir=str(tmp_path), packed_buffer_size_bytes=50_000
    )
    sync = WeightSync.start(config, model, transport=lambda: GlooTransport(timeout_s=20))
    sent = lambda: checksums({n: p.detach() for n, p in model.named_parameters()})  # noqa: E731
    try:
        for version in (1, 2):
            perturb(model, version, skip="")
            timings = sync.sync(model, version)
            assert checksums(a.weights) == sent() == checksums(b.weights)
        assert timings.num_bytes == 2 * sum(p.nbytes for p in model.parameters()), "one pass per server"
        b = _restart(b)
        perturb(model, 3, skip="")
        sync.sync(model, 3)
        assert checksums(a.weights) == sent() == checksums(b.weights)
        assert b.calls[:4] == [
            "/weight_info",
            "/shutdown_weight_transfer_engine",
            "/pause",
            "/get_world_size",
        ]
        assert (
            "/init_weight_transfer_engine" in b.calls and "/init_weight_transfer_engine" not in a.calls[-8:]
        )
        assert (a.state["version"], b.state["version"], sync.members) == ("3", "3", {0, 1})
    finally:
        sync.close()
        for worker in (a, b):
            worker.http.stop()


@pytest.mark.usefixtures("labelled_stubs")
def test_lora_window_is_kept_on_every_server_and_a_restarted_one_gets_it_back(tmp_path, tiny_model):
    from peft import LoraConfig, get_peft_model

    lora = {"max_lora_rank": 8, "max_loras": 4}
    a, b = _stub(lora=lora), _stub(lora=lora)
    model = get_peft_model(tiny_model(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    config = WeightSyncConfig(
        base_url=[a.url, b.url], output_dir=str(tmp_path), max_staleness=1, lora_name="agrpo-test"
    )
    sync = WeightSync.start(config, model)
    window = lambda *versions: {adapter_name("agrpo-test", v) for v in versions}  # noqa: E731
    try:
        assert sync.backend_name == "lora"
        for version in (1, 2, 3):
            sync.sync(model, version)
        assert set(a.adapters) == set(b.adapters) == window(2, 3)  # max_staleness + 1 versions
        b = _restart(b, lora=lora)
        sync.sync(model, 4)
        assert set(a.adapters) == window(3, 4) and set(b.adapters) == window(3, 4), "B got the window back"
        assert (a.state["version"], b.state["version"]) == ("4", "4")
        assert sorted(p.name for p in (tmp_path / ".vllm_lora").iterdir()) == sorted(window(3, 4))
    finally:
        sync.close()
        assert a.adapters == {} and b.adapters == {}
        for worker in (a, b):
            worker.http.stop()
