"""`NcclTransport` on a machine without NCCL: the library lookup and the errors that name the fix.
(Its collectives are exercised on two H200s by `tools/bench/weight_sync`.)"""

from __future__ import annotations

import pytest

from agrpo_sync import NcclTransport, TransportError
from agrpo_sync._nccl_transport import find_nccl_library


def test_an_explicit_library_path_wins():
    assert find_nccl_library("/opt/nccl/libnccl.so.2") == "/opt/nccl/libnccl.so.2"
    assert find_nccl_library("").endswith(("libnccl.so.2", ".so"))


def test_a_missing_library_names_the_setting():
    transport = NcclTransport(library_path="/nonexistent/libnccl.so.2")
    with pytest.raises(TransportError, match="nccl_library"):
        transport.new_unique_id()


def test_a_unique_id_of_the_wrong_size_is_refused_before_touching_a_gpu():
    with pytest.raises(TransportError, match="128"):
        NcclTransport().connect(b"short", rank=0, world_size=2)
