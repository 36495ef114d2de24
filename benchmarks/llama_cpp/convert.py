"""Run llama.cpp's convert_hf_to_gguf.py with the token list cut to the model's vocab_size.

The 95M benchmark model borrows stories260k's 512-token tokenizer.json; the vendored converter's
LlamaHfVocab lists 1024 tokens for it (the tokenizer's 512 and 512 more), and llama-server then
refuses the GGUF (token_embd.weight is 512 x 512, not 512 x 1024). The first 512 entries are the
tokenizer's ids 0..511, so the list is cut there; requests are token ids, so no text is involved.

Usage (gguf-py on PYTHONPATH): python convert.py CONVERT_HF_TO_GGUF_PY MODEL_DIR [converter args...]
"""

import itertools
import json
import runpy
import sys
from pathlib import Path

import gguf

script, model_dir = sys.argv[1], Path(sys.argv[2])
vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
_init, _all_tokens = gguf.LlamaHfVocab.__init__, gguf.LlamaHfVocab.all_tokens


def _cut_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.vocab_size = min(self.vocab_size, vocab_size)


gguf.LlamaHfVocab.__init__ = _cut_init
gguf.LlamaHfVocab.all_tokens = lambda self: itertools.islice(_all_tokens(self), self.vocab_size)
sys.path.insert(0, str(Path(script).resolve().parent))  # its conversion package
sys.argv = [script, str(model_dir), *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
