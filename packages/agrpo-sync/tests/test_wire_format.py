"""The packed wire format: chunk boundaries, packing, and byte-for-byte agreement with vLLM's own code."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_rollout.testing import ensure_vllm_env
from agrpo_sync import (
    ParamStream,
    TensorMeta,
    TransportError,
    pack_chunk,
    plan_chunks,
    unpack_chunk,
    update_info,
)
from agrpo_sync._param_stream import plain_entries
from agrpo_sync._wire_format import chunk_tensors

PROBE = Path(__file__).with_name("vllm_packing_probe.py")


def _metas(*sizes: int) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", torch.uint8, (n,)) for i, n in enumerate(sizes)]


def test_a_chunk_closes_only_when_its_total_exceeds_the_buffer():
    plans = plan_chunks(_metas(4, 6, 5, 1), buffer_size_bytes=10)
    assert [(p.start, p.stop, p.nbytes) for p in plans] == [(0, 3, 15), (3, 4, 1)]


def test_a_tensor_larger_than_the_buffer_closes_its_chunk_and_the_tail_is_sent():
    plans = plan_chunks(_metas(30, 2, 3), buffer_size_bytes=10)
    assert [(p.start, p.stop) for p in plans] == [(0, 1), (1, 3)]
    assert plan_chunks([], 10) == []


def test_unpack_inverts_pack_for_mixed_dtypes_and_scalars():
    tensors = [torch.randn(3, 4).bfloat16(), torch.tensor(2.5), torch.arange(6, dtype=torch.int64).view(2, 3)]
    metas = [TensorMeta(f"w{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]
    for (name, got), want, meta in zip(unpack_chunk(pack_chunk(tensors), metas), tensors, metas, strict=True):
        assert name == meta.name and torch.equal(got, want)
    with pytest.raises(TransportError, match="announces"):
        unpack_chunk(torch.zeros(3, dtype=torch.uint8), metas)


def test_update_info_names_dtypes_and_shapes_as_vllm_reads_them():
    info = update_info([TensorMeta("a.weight", torch.bfloat16, (2, 3)), TensorMeta("b", torch.float32, ())])
    assert info == {
        "names": ["a.weight", "b"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[2, 3], []],
    }


def test_chunk_tensors_refuses_a_stream_that_disagrees_with_the_announced_metadata():
    metas = _metas(2, 2)
    plans = plan_chunks(metas, 100)
    wrong = [("t0", torch.zeros(2, dtype=torch.uint8)), ("t1", torch.zeros(3, dtype=torch.uint8))]
    with pytest.raises(TransportError, match="'t1'"):
        list(chunk_tensors(wrong, metas, plans))
    with pytest.raises(TransportError, match="ended before 't1'"):
        list(chunk_tensors(wrong[:1], metas, plans))


def _tiny_model_tensors() -> tuple[ParamStream, list[tuple[str, torch.Tensor]]]:
    model = build_model(TinyModelSpec(num_layers=2), build_tokenizer()).to(torch.bfloat16)
    for name, param in model.named_parameters():  # mixed dtypes on the wire: norms stay float32
        if "norm" in name:
            param.data = param.data.float()
    stream = ParamStream(plain_entries(model, None, ()), bucket_bytes=10_000)
    return stream, [(n, t.clone()) for n, t in stream]


def test_packing_matches_vllm_pack_tensors_and_unpack_tensor_byte_for_byte(tmp_path):
    """Wire compatibility: for a real (tiny, random) model, vLLM's producer emits exactly our chunks, and
    vLLM's consumer requests our chunk sizes and unpacks every tensor from our bytes unchanged."""
    stream, tensors = _tiny_model_tensors()
    metas = stream.metadata()
    sizes = [m.nbytes for m in metas]
    buffer_sizes = [
        1,
        sum(sizes[:3]),
        50_000,
        sum(sizes) - 1,
        1 << 30,
    ]  # per tensor, exact fit, mid, last, one
    cases = []
    for buffer_size in buffer_sizes:
        plans = plan_chunks(metas, buffer_size)
        chunks = [pack_chunk(group) for group in chunk_tensors(iter(tensors), metas, plans)]
        cases.append({"buffer_size": buffer_size, "chunks": chunks, "plans": plans})
    torch.save(
        {"tensors": tensors, "cases": [{k: c[k] for k in ("buffer_size", "chunks")} for c in cases]},
        tmp_path / "in.pt",
    )
    python = ensure_vllm_env()
    done = subprocess.run(
        [str(python), str(PROBE), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = torch.load(tmp_path / "out.pt")
    for case, result in zip(cases, results, strict=True):
        ours = case["chunks"]
        assert len(result["vllm_chunks"]) == len(ours) == len(case["plans"]), case["buffer_size"]
        assert all(torch.equal(v, o) for v, o in zip(result["vllm_chunks"], ours, strict=True)), case[
            "buffer_size"
        ]
        assert result["consumer_sizes"] == [c.numel() for c in ours]
        assert [n for n, _ in result["loaded"]] == [n for n, _ in tensors]
        for (_, got), (_, want) in zip(result["loaded"], tensors, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert len(cases[0]["chunks"]) == len(metas) and len(cases[-1]["chunks"]) == 1
