"""Mistral's real tokenizers as ``tokenizer.json``, run in a child interpreter with the
``mistral_common`` side stack first on ``PYTHONPATH`` (tests/support/real_families.py starts it;
``make install-compat`` installs the stack: ``mistral_common`` pins numpy < 2.4 on Python <= 3.12,
so it is installed with ``--no-deps --target``, beside this environment's numpy 2.4).

``convert FILE OUT``: Mistral's own tokenizer file from the ``mistral_common`` wheel
(``mistral_common/data/FILE``: a tekken JSON, or a SentencePiece ``.model.vN``) converted by
transformers -- tekken by ``MistralConverter``, SentencePiece by
``SpmConverter.build_tokenizer_from_spm_proto``, which follows the model's own normalizer spec --
and checked against ``mistral_common``'s tokenizer of the same file: the same ids on every sample
text (:data:`SAMPLES` and the generated ones) and the same id for every control token. Prints the
figures as JSON; exits 1 naming the first difference.

``chat FILE``: reads conversations (JSON lines of ``{"messages", "tools"}`` in the OpenAI form) on
stdin and prints, per line, the ids of ``mistral_common``'s own request encoding
(``MistralTokenizer.encode_chat_completion``; the last assistant turn is ended by the eos token
the instruct tokenizer writes after assistant messages), or the error it raises.
"""

from __future__ import annotations

import json
import os
import random
import sys

import mistral_common
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")

#: leading, repeated and trailing spaces, tabs and newlines, unicode, code, JSON (not a control token's
#: spelling: a ``tokenizer.json`` reads ``[INST]`` in a text as the control token, as a chat template's
#: rendering needs, ``mistral_common`` as text)
SAMPLES = ("Hello world! Merhaba, nasılsın? 12345", " leading", "  two  spaces\t", "   three", "trailing   ",
           "\n\nnew\nlines\r\n", "\t\ttabs", "def f(x):\n    return x ** 2\n\n\n", "日本語のテキスト 😀 👍🏽",
           '{"city": "Paris", "unit": "c"}', "İstanbul ığdır ŞĞÜ", "a\u00a0b\u200bc", "  ", " ", "\n",
           "[INST ] INST] /INST", "<s text", "naïve café résumé", "x" * 300,
           "1234567890 3.14159 -2e10", "Ж ع한 ﷽")


def _generated(n: int = 4000):
    rng = random.Random(0)
    alphabet = [" ", "  ", "\t", "\n", "\r\n", "a", "Z", "é", "ß", "日", "😀", "👍🏽", "1", "23", "!", '"', "{", "}",
                "ı", "İ", "ş", "\u200b", "\u00a0", "ع", "Ж", "한", "the", " of", "def", "▁"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def _mistral(name: str) -> MistralTokenizer:
    """(the finetuning mode validates a conversation that ends with an assistant turn)"""
    return MistralTokenizer.from_file(os.path.join(DATA, name), mode=ValidationMode.finetuning)


def _tekken(path: str):
    from transformers.integrations.mistral.tokenizer import MistralConverter
    return MistralConverter(path).converted()


def _sentencepiece(path: str):
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter
    extractor = SentencePieceExtractor(path)
    extracted = extractor.extract(BPE)
    converted = SpmConverter.build_tokenizer_from_spm_proto(extractor.proto, vocab=extracted["vocab"])
    converted.add_special_tokens(extracted["additional_special_tokens"])
    return converted


def convert(name: str, out: str) -> dict:
    path = os.path.join(DATA, name)
    converted = _tekken(path) if name.startswith("tekken") else _sentencepiece(path)
    converted.save(out)
    from tokenizers import Tokenizer
    hf = Tokenizer.from_file(out)
    own = _mistral(name).instruct_tokenizer.tokenizer
    texts = list(SAMPLES) + _generated()
    for text in texts:
        got, want = hf.encode(text, add_special_tokens=False).ids, own.encode(text, bos=False, eos=False)
        if got != want:
            sys.exit(f"the converted {name} encodes {text!r} as {got[:12]}, mistral_common as {want[:12]}")
    controls = [own.id_to_piece(i) for i in range(own.num_special_tokens)]
    for id_, piece in enumerate(controls):
        # (SentencePiece's <unk> is no control token: its spelling in a text is text, as in mistral_common)
        whole = (piece == "<unk>" and not name.startswith("tekken")
                 or hf.encode(piece, add_special_tokens=False).ids == [id_])
        if hf.token_to_id(piece) != id_ or not whole:
            sys.exit(f"the converted {name} gives the control token {piece} another id than mistral_common ({id_})")
    if hf.get_vocab_size() != own.n_words:
        sys.exit(f"the converted {name} has {hf.get_vocab_size()} ids, mistral_common {own.n_words}")
    return {"texts": len(texts), "chars": sum(map(len, texts)), "controls": len(controls), "vocab": own.n_words}


def chat(name: str, lines) -> list:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    tokenizer = _mistral(name)
    out = []
    for line in lines:
        record = json.loads(line)
        try:
            request = ChatCompletionRequest(messages=record["messages"], tools=record.get("tools"))
            out.append({"ids": tokenizer.encode_chat_completion(request).tokens})
        except Exception as e:   # (the refusal is the answer: reported, not raised)
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out


if __name__ == "__main__":
    if sys.argv[1] == "convert":
        print(json.dumps(convert(sys.argv[2], sys.argv[3])))
    elif sys.argv[1] == "chat":
        print(json.dumps(chat(sys.argv[2], sys.stdin)))
    else:
        sys.exit(f"usage: {sys.argv[0]} convert FILE OUT | chat FILE < conversations.jsonl")
