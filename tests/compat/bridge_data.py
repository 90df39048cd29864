"""Packed data written by the installed Megatron-Bridge's own code, from small seeded inputs.

``prepare_gpt_sft_packed_data`` (Bridge's offline packer) tokenizes with a real Bridge
tokenizer built from the bundled BPE tokenizer (``examples/tokenizer``), through Bridge's
own dataset builder (``build_gpt_sft_split``): prompt-template examples (loss from
``answer_start_idx``) and chat examples (loss from the chat template's assistant mask),
with and without context-parallel padding, as legacy ``.npy`` and packed Parquet.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = os.path.join(ROOT, "examples", "tokenizer")
PACK_SIZE = 128
WORDS = ("numpy arrays store numbers of one type contiguously which makes them fast; packs hold "
         "several sequences and a loss mask so the model trains on answers only").split()


@dataclass(frozen=True)
class BridgeArtifact:
    kind: str          # "prompt" or "chat"
    pad_seq_to_mult: int
    npy: str
    parquet: str
    metadata: str      # Bridge's packing-metadata JSON (one entry per file written)


def bridge_tokenizer():
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

    return build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=TOKENIZER))


def _prompt_examples(path: Path, n: int, seed: int) -> None:
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input": " ".join(rnd.choices(WORDS, k=rnd.randint(1, 18))),
                                "output": " ".join(rnd.choices(WORDS, k=rnd.randint(1, 10)))}) + "\n")


def _chat_examples(path: Path, n: int, seed: int) -> None:
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            turns = [{"role": "system", "content": "You are a helpful assistant."}]
            for _ in range(rnd.randint(1, 2)):
                turns.append({"role": "user", "content": " ".join(rnd.choices(WORDS, k=rnd.randint(1, 6)))})
                turns.append({"role": "assistant", "content": " ".join(rnd.choices(WORDS, k=rnd.randint(1, 8)))})
            f.write(json.dumps({"messages": turns}) + "\n")


def write_bridge_artifacts(out: Path, tokenizer, kinds=("prompt", "chat"), mults=(1, 4), n: int = 64):
    """Every (kind, pad_seq_to_mult) written by Bridge as .npy and Parquet; returns the artifacts."""
    from megatron.bridge.data.builders.gpt_sft import build_gpt_sft_split
    from megatron.bridge.data.packing.offline import prepare_gpt_sft_packed_data

    artifacts = []
    for kind in kinds:
        src = out / f"{kind}.jsonl"
        (_prompt_examples if kind == "prompt" else _chat_examples)(src, n, seed=len(kind))
        kwargs = {} if kind == "prompt" else {"chat": True, "use_hf_tokenizer_chat_template": True}
        for mult in mults:
            stem = out / f"{kind}_cp{mult}"
            meta = Path(f"{stem}.meta.json")
            for suffix in (".npy", ".parquet"):
                prepare_gpt_sft_packed_data(
                    input_path=src, output_path=Path(f"{stem}{suffix}"), output_metadata_path=meta,
                    packed_sequence_size=PACK_SIZE, tokenizer=tokenizer, max_seq_length=PACK_SIZE, seed=0,
                    packing_algorithm="first_fit_shuffle", dataset_kwargs=dict(kwargs), pad_seq_to_mult=mult,
                    num_tokenizer_workers=1, dataset_builder=build_gpt_sft_split)
            artifacts.append(BridgeArtifact(kind, mult, f"{stem}.npy", f"{stem}.parquet", str(meta)))
    return artifacts
