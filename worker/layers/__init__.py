"""Tensor-parallel building blocks of the model families (see worker/models/)."""
