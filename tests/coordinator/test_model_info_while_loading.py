"""GetModelInfo while the model loads answers UNAVAILABLE, as Generate does (docs/design/faults.md, "GetModelInfo is
UNAVAILABLE while loading").

Before the ranks report ready, the KV pool size and the resolved dtype are unknown;
answering OK with ``num_kv_blocks=0`` and an empty dtype would look like facts.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.errors import UnavailableError
from coordinator.server import GenerationServicer
from coordinator.tokenizer import Tokenizer
from tpserve.embedded_model import default_model_dir
from tpserve.v1 import generate_pb2 as pb


def test_get_model_info_is_unavailable_until_the_engine_runs() -> None:
    info = pb.ModelInfo(model_name="m", max_model_len=512, vocab_size=512, num_kv_blocks=0)
    servicer = GenerationServicer(None, Tokenizer.from_pretrained(default_model_dir()), info)
    with pytest.raises(UnavailableError, match="loading") as caught:
        asyncio.run(servicer.GetModelInfo(pb.GetModelInfoRequest(), None))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    servicer.engine = object()  # started: the cluster sets the engine and the full model_info together
    assert asyncio.run(servicer.GetModelInfo(pb.GetModelInfoRequest(), None)) is info
