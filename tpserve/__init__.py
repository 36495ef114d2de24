"""tpserve: a gRPC, tensor-parallel inference server for Llama-family language models.

Shared ground for the coordinator and the workers: the step protocol
(:mod:`tpserve.step`), the Hugging Face model config (:mod:`tpserve.model_config`),
configuration, logging, generated protobuf stubs and the client library.
Nothing here imports torch.
"""

__version__ = "0.1.0"
