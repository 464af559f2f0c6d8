"""A transformers checkpoint to an f32 GGUF with llama.cpp's own converter.

The reference checkpoints (testkit/python/hf_reference.py) carry a word-level tokenizer that
llama.cpp's converter does not know (it recognises tokenizers by a hash of how they split a
test text). The llama.cpp plugin is fed token ids by the tests, so the vocabulary only has to
load: this wrapper gives the converter the checkpoint's tokens as a GPT-2-style vocabulary with
one placeholder merge (llama.cpp refuses a BPE vocabulary without merges), then runs the
converter unchanged on everything else (tensor names, layouts, hyper-parameters).

Usage: hf_to_gguf.py LLAMA_CPP_DIR [--outtype f32|bf16] MODEL_DIR OUT.gguf [MODEL_DIR OUT.gguf ...]
(several in one process: PyTorch and the converter are imported once; f32 unless told)
LLAMA_CPP_DIR holds convert_hf_to_gguf.py, conversion/ and gguf-py/ (the llama.cpp release
whose server bench/build-llama-server.sh builds, from the same PyPI sdist).
"""
import importlib
import json
import pkgutil
import runpy
import sys
from pathlib import Path


def main():
    src, pairs = Path(sys.argv[1]), sys.argv[2:]
    outtype = "f32"
    if pairs[:1] == ["--outtype"]:
        outtype, pairs = pairs[1], pairs[2:]
    if not pairs or len(pairs) % 2:
        sys.exit(__doc__)
    sys.path.insert(0, str(src))
    sys.path.insert(1, str(src / "gguf-py"))
    import conversion
    import conversion.base as base

    def get_vocab_base(self):
        vocab = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())["model"]["vocab"]
        n = self.hparams["vocab_size"]
        by_id = {i: t for t, i in vocab.items()}
        return [by_id.get(i, f"[PAD{i}]") for i in range(n)], [1] * n, "default"

    def set_vocab(self):
        self._set_vocab_gpt2()
        self.gguf_writer.add_token_merges(["t 0"])

    # Every model class, so the overrides reach the ones that define their own vocabulary;
    # BERT's own set_vocab is kept: it reads the tokens through get_vocab_base (replaced above)
    # and writes what llama.cpp's BERT needs besides (WordPiece model, token type count).
    for m in pkgutil.iter_modules(conversion.__path__):
        importlib.import_module(f"conversion.{m.name}")
    base.TextModel.get_vocab_base = get_vocab_base
    stack = [base.TextModel]
    while stack:
        cls = stack.pop()
        if "set_vocab" in cls.__dict__ and cls.__name__ != "BertModel":
            cls.set_vocab = set_vocab
        stack.extend(cls.__subclasses__())
    for model_dir, out in zip(pairs[::2], pairs[1::2]):
        sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outtype", outtype, "--outfile", out]
        runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
