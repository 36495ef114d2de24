"""Training of tpserve's default model, ``tpserve/default_model`` (not part of CI).

``corpus``: the seeded grammar that writes the training text;
``tokenizer``: the byte-fallback BPE tokenizer;
``train``: ``python -m training.train --out tpserve/default_model``;
``evaluate``: ``python -m training.evaluate --model tpserve/default_model``.
"""
