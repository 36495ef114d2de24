"""Tensor-parallel building blocks of the Llama-family model (see worker/model.py)."""
